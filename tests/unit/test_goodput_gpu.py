"""The goodput comparison's parts without a cluster: set-up specs, the decode step from a
closed-loop run, the table and its checks, the budget."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.decode_step import steady_step_ms, token_times
from pdserve.bench.goodput_gpu import main
from pdserve.bench.goodput_setups import DEFAULT_RATES, parse_setup
from pdserve.bench.goodput_table import checks, format_table


def test_setup_specs():
    s = parse_setup("spatial:0.4+slo@2/4/8")
    assert (s.name, s.kind, s.arg, s.slo_dispatch, s.rates) == (
        "spatial:0.4+slo", "spatial", "0.4", True, (2.0, 4.0, 8.0))
    args = s.up_args(1000, 12)
    assert args[:4] == ["--prefill", "1", "--decode", "1"]
    assert "--spatial" in args and args[args.index("--prefill-sm-share") + 1] == "0.4"
    assert "--router-arg=--slo-ttft-ms=1000" in args and "--router-arg=--slo-itl-ms=12" in args
    m = parse_setup("mixed:512")
    assert m.rates == DEFAULT_RATES["mixed"] and not m.slo_dispatch
    assert "--worker-arg=--chunked-prefill-size=512" in m.up_args(1000, 12)
    assert "--mixed" in m.up_args(1000, 12) and "--spatial" not in m.up_args(1000, 12)
    t = parse_setup("timesliced")
    assert t.up_args(1000, 12) == ["--prefill", "1", "--decode", "1", "--no-spatial"]
    assert "--prefill-sm-share" not in parse_setup("spatial").up_args(1000, 12)
    o = parse_setup("spatial:0.6/1.0@10/12")
    assert (o.kind, o.arg, o.rates, o.dir_name) == ("spatial", "0.6/1.0", (10.0, 12.0),
                                                    "spatial-0.6-1.0")
    assert o.up_args(1000, 12)[-3:] == ["--spatial", "--prefill-sm-share=0.6",
                                        "--decode-sm-share=1.0"]
    for bad in ("gpu", "spatial:1.5", "spatial:x", "spatial:0.6/1.5", "spatial:0.5/x",
                "spatial:0.2/0.3/0.5", "mixed:0", "mixed:51.5", "timesliced:3",
                "mixed+fast", "mixed@1/x"):
        with pytest.raises(ValueError, match="setups"):
            parse_setup(bad)


def _req(start: float, ttft_ms: float, gaps_ms: list[float]) -> dict:
    return {"ok": True, "start_s": start, "ttft_ms": ttft_ms, "itl_ms": gaps_ms}


def test_decode_step_from_the_window_where_all_decode():
    assert token_times(_req(1.0, 500, [10, 20])) == pytest.approx([1.5, 1.51, 1.53])
    # Three requests: prefills end at 0.1, 0.2 and 0.3 s; while all three decode the step is
    # 8 ms, before (fewer running) 5 ms; the first one ends at about 0.5 s.
    reqs = [_req(0.0, 100, [5] * 40 + [8] * 25), _req(0.0, 200, [5] * 20 + [8] * 40),
            _req(0.0, 300, [8] * 40), {"ok": False, "ttft_ms": None}]
    step, batch, used = steady_step_ms({"requests": reqs})
    assert step == pytest.approx(8.0) and batch == 3 and used > 40
    assert steady_step_ms({"requests": []}) == (None, 0, 0)
    # Someone finished before the last prefill ended: no common window.
    assert steady_step_ms({"requests": [_req(0, 10, [1]), _req(0, 500, [1])]})[0] is None


def _row(name: str, kind: str, interp: float, best: float | None, itl_p99: float = 10.0,
         step: float | None = 8.0) -> dict:
    point = {"rate": best or 1.0, "itl_p99_ms": itl_p99, "batch_mean": 12.0}
    return {"name": name, "kind": kind, "status": "ok", "ready_s": 60.0, "spatial": "",
            "notes": [], "step_ms": step, "step_batch": 12,
            "sweep": {"max_rate": best, "max_rate_interpolated": interp, "max_goodput": interp,
                      "points": [point]}}


def test_table_and_checks():
    rows = [_row("spatial", "spatial", 9.0, 8.0, itl_p99=11.0),
            _row("mixed:512", "mixed", 4.0, 4.0), _row("mixed:2048", "mixed", 3.0, 2.0),
            _row("timesliced", "timesliced", 2.0, 2.0)]
    got = checks(rows)
    assert got[0].startswith("goodput spatial / mixed:512: 9.00 / 4.00 req/s = 2.25x")
    assert got[0].endswith("met)") and "NOT" not in got[0]
    assert "= 1.38 (target <= 1.5: met)" in got[1] and "batch 12" in got[1]
    rows[0]["sweep"]["max_rate_interpolated"] = 6.0
    rows[0]["sweep"]["points"][0]["itl_p99_ms"] = 16.0
    got = checks(rows)
    assert "1.50x (target >= 2x: NOT met)" in got[0] and "2.00 (target <= 1.5: NOT met)" in got[1]
    table = format_table(rows + [{"name": "spatial:0.3", "kind": "spatial", "status":
                                  "skipped: 20 s left of the budget", "notes": []}])
    lines = table.splitlines()
    assert lines[1].split()[0] == "set-up" and lines[-1].startswith("=")
    assert "skipped: 20 s left" in table and "mixed:2048" in table
    assert checks([_row("mixed", "mixed", 4.0, 4.0)])[0].startswith("goodput ratio: needs")


def test_budget_skips_and_reports(tmp_path, capsys):
    rc = main(["--setups", "spatial,mixed:512", "--budget-s", "1", "--out", str(tmp_path)])
    assert rc == 1
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("=" * 20)  # the table comes last
    assert out.count("skipped:") == 2
    data = json.loads((tmp_path / "goodput.json").read_text())
    assert [r["status"][:8] for r in data["setups"]] == ["skipped:"] * 2
    assert main(["--setups", "gpu"]) == 2


def test_interference_summary():
    from pdserve.bench.gpu_spatial import summarize

    base = summarize({"decode": [10.0, 10.0], "prefill": [100.0]}, None)
    assert base["decode_per_s"] == pytest.approx(100) and "work" not in base
    got = summarize({"decode": [10.0, 12.0, 14.0], "prefill": [200.0, 200.0]}, base)
    assert got["decode_p50_ms"] == 12.0 and 13.9 < got["decode_p99_ms"] <= 14.0
    # 1000/12 decode steps/s of 100 and 5 prefills/s of 10: 0.83 + 0.5 of a GPU's work.
    assert got["work"] == pytest.approx(1000 / 12 / 100 + 0.5)
    with pytest.raises(RuntimeError, match="prefill"):
        summarize({"decode": [1.0], "prefill": []}, None)
