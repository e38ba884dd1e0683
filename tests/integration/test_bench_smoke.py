"""`pdserve bench` against a real tiny cluster: report fields, zero failures, PNG plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fixtures.cluster import start_cluster


@pytest.fixture(scope="module")
def tiny_cluster(tiny_model_dir):
    c = start_cluster(tiny_model_dir, prefill=1, decode=1)
    yield c
    assert c.stop() == 0, "".join(c.log[-30:])


def _bench(cluster, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pdserve", "bench", "--base-url", cluster.url,
            "--no-progress", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_cpu_cluster_has_no_gpu_to_split(tiny_cluster):
    """On the CPU, `pdserve up` (spatial by default where workers share a GPU) says nothing of
    MPS: no message, no split on its ready line."""
    ready = next(x for x in tiny_cluster.log if x.startswith("pdserve ready"))
    assert "spatial" not in ready and not any("spatial:" in x for x in tiny_cluster.log)


@pytest.mark.timeout(180)
def test_bench_smoke(tiny_cluster, tmp_path):
    out = tmp_path / "bench"
    proc = _bench(tiny_cluster, "--num-prompts", "12", "--max-concurrency", "4",
                  "--input-len", "8:24", "--output-len", "6:12", "--warmup", "1",
                  "--slo-ttft", "30000", "--slo-itl", "30000", "--poll-interval", "0.2",
                  "--output-dir", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["completed"] == 12 and line["failed"] == 0 and line["errors"] == {}

    report = json.loads((out / "bench_report.json").read_text())
    s = report["summary"]
    assert report["model"] and s["completed"] == 12 and s["failed"] == 0
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        st = s[name]
        assert st["count"] > 0 and 0 < st["p50"] <= st["p90"] <= st["p99"] <= st["max"]
    assert s["itl_ms"]["count"] >= 12 * 5  # one gap per token after the first
    assert 6 * 12 <= s["total_output_tokens"] <= 12 * 12  # ignore_eos: lengths as asked
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # SLOs set out of reach
    assert s["slo_attainment"] == 1.0
    stages = s["stages"]
    assert stages["source"] == "responses" and stages["count"] == 12
    assert stages["stages_ms"]["prefill"]["mean"] > 0
    assert report["timeline"]["queue"], "no /workers samples"
    assert len(report["requests"]) == 12
    assert all(r["prefill_worker"] and r["decode_worker"] for r in report["requests"])
    for png in ("latency_cdf.png", "timeline.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(out / png) < 100_000


@pytest.mark.timeout(120)
def test_bench_chat_poisson_and_failures_counted(tiny_cluster):
    proc = _bench(tiny_cluster, "--endpoint", "chat", "--dataset", "shared-prefix",
                  "--num-prompts", "4", "--prefix-len", "16", "--input-len", "8",
                  "--output-len", "4", "--request-rate", "20", "--warmup", "0", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["completed"] == 4 and s["total_output_tokens"] == 16
    # A model the router does not serve: every request fails, the run still reports.
    proc = _bench(tiny_cluster, "--model", "no-such-model", "--num-prompts", "3",
                  "--output-len", "4", "--warmup", "0", "--json")
    assert proc.returncode == 1, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["completed"] == 0 and s["failed"] == 3
    assert "404" in next(iter(s["errors"]))


@pytest.mark.timeout(180)
def test_rate_sweep_goodput_and_nothing_leaked(tiny_cluster, tmp_path):
    out = tmp_path / "sweep"
    proc = _bench(tiny_cluster, "--sweep-rate", "4,16", "--sweep-duration", "1",
                  "--input-len", "8:16", "--output-len", "4", "--warmup", "1",
                  "--slo-ttft", "30000", "--slo-itl", "30000", "--label", "tiny",
                  "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "highest rate with >= 90% attainment: 16 req/s" in proc.stdout, proc.stdout
    report = json.loads((out / "sweep_report.json").read_text())
    sweep = report["sweep"]
    assert sweep["label"] == "tiny" and sweep["max_rate"] == 16
    assert [p["rate"] for p in sweep["points"]] == [4, 16]
    assert [p["sent"] for p in sweep["points"]] == [4, 16]  # ~1 s of arrivals per rate
    for point, rate in zip(sweep["points"], report["rates"]):
        assert point["failed"] == 0 and point["attainment"] == 1.0
        assert point["goodput"] == pytest.approx(point["request_throughput"])
        assert len(rate["requests"]) == point["sent"]
        assert all(r["ok"] and r["output_tokens"] == 4 for r in rate["requests"])
    assert (out / "attainment.png").read_bytes()[:4] == b"\x89PNG"
    # An SLO nobody meets: the sweep stops after the first rate.
    proc = _bench(tiny_cluster, "--sweep-rate", "4,8", "--sweep-duration", "0.5",
                  "--input-len", "8", "--output-len", "2", "--warmup", "0", "--slo-ttft", "0.001",
                  "--sweep-stop-below", "0.5", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rates 8 not run" in proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [p["rate"] for p in line["points"]] == [4] and line["max_rate"] is None
    # Every page and slot came back once the sweeps ended.
    for w in tiny_cluster.wait_idle():
        assert w["kv_pages_in_use"] == 0 and w["num_running"] == 0 and w["num_waiting"] == 0
