"""The goodput comparison end to end on the tiny model (CPU): a served set-up swept, its
decode step measured, the cluster stopped cleanly, the table printed last."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.goodput_gpu import main


@pytest.mark.timeout(240)
def test_goodput_comparison_on_cpu(tiny_model_dir, tmp_path, capsys):
    rc = main(["--setups", "mixed:64@4/8", "--model-args", f"--model {tiny_model_dir}",
               "--device", "cpu", "--duration", "1", "--input-len", "16", "--output-len", "4",
               "--slo-ttft", "30000", "--slo-itl", "30000", "--budget-s", "200",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    row = json.loads((tmp_path / "goodput.json").read_text())["setups"][0]
    assert row["status"] == "ok" and row["notes"] == []  # `pdserve up` exited 0
    assert [p["rate"] for p in row["sweep"]["points"]] == [4, 8]
    assert row["sweep"]["max_rate"] == 8 and row["step_ms"] > 0 and row["step_batch"] >= 1
    assert (tmp_path / "mixed-64" / "sweep_report.json").exists()
    assert (tmp_path / "attainment.png").read_bytes()[:4] == b"\x89PNG"
    lines = out.rstrip().splitlines()
    assert lines[-1].startswith("=" * 20) and any(x.startswith("mixed:64") for x in lines)
