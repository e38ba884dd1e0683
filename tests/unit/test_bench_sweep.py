"""Rate sweep and goodput computation on synthetic results (no cluster)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serve_client import RequestResult
from pdserve.bench.serve_config import BenchConfig, config_from_args
from pdserve.bench.serve_goodput import (
    SweepPoint,
    format_sweep_table,
    interpolated_rate,
    max_rate_meeting,
    parse_rates,
    points_from_json,
    requests_at,
    sweep_summary,
)
from pdserve.bench.serve_metrics import summarize
from pdserve.bench.serve_runner import QueueSample, RunOutcome
from pdserve.bench.serve_sweep import SEED_STRIDE, rate_config
from pdserve.bench.serve_sweep_plot import comparison_table, load_summary, plot_attainment


def _point(rate: float, attainment: float, sent: int = 10) -> SweepPoint:
    return SweepPoint(rate=rate, sent=sent, completed=sent, failed=0, duration_s=sent / rate,
                      request_throughput=rate, output_throughput=rate * 100,
                      goodput=rate * attainment, attainment=attainment, ttft_p50_ms=1.0,
                      ttft_p99_ms=2.0, tpot_p50_ms=3.0, tpot_p99_ms=4.0, itl_p99_ms=5.0)


def _result(ttft_s: float, itl_s: float, n: int, error: str | None = None) -> RequestResult:
    r = RequestResult(input_len=8, output_len=n)
    if error is None:
        r.chunk_times = [ttft_s + k * itl_s for k in range(n)]
        r.chunk_tokens = [1] * n
        r.end_s = r.chunk_times[-1]
    else:
        r.error = error
    return r


def test_parse_rates_and_flags():
    assert parse_rates("1,2,4.5") == (1.0, 2.0, 4.5)
    for bad in ("", "x", "2,1", "1,1", "0,1", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="sweep_rates"):
            parse_rates(bad)
    cfg = config_from_args(["--sweep-rate", "0.5,1,2", "--sweep-duration", "10",
                            "--slo-attainment", "0.95", "--label", "x", "--slo-itl", "12"])
    assert cfg.sweep_rates == (0.5, 1.0, 2.0) and cfg.sweep_duration_s == 10
    assert cfg.slo_target == 0.95 and cfg.label == "x" and cfg.slo_itl_ms == 12
    for kw, field in ((dict(sweep_rates=(2.0, 1.0)), "sweep_rates"),
                      (dict(sweep_duration_s=-1.0), "sweep_duration_s"),
                      (dict(slo_target=0.0), "slo_target"),
                      (dict(slo_target=1.5), "slo_target"),
                      (dict(sweep_stop_below=2.0), "sweep_stop_below")):
        with pytest.raises(ValueError, match=field):
            BenchConfig(**kw)


def test_requests_per_rate_and_seeds_move():
    assert requests_at(4.0, 50, 0.0) == 50
    assert requests_at(4.0, 50, 10.0) == 40 and requests_at(0.01, 50, 10.0) == 1
    cfg = BenchConfig(seed=3, num_prompts=7, sweep_rates=(1.0, 2.0), sweep_duration_s=5.0)
    r1 = rate_config(cfg, 1, 2.0)
    assert r1.request_rate == 2.0 and r1.num_prompts == 10 and r1.sweep_rates == ()
    assert r1.seed == 3 + SEED_STRIDE and rate_config(cfg, 0, 1.0).seed == 3


def test_goodput_per_rate_counts_both_slos_and_failures():
    cfg = BenchConfig(slo_ttft_ms=1000, slo_itl_ms=12)
    results = [_result(0.5, 0.010, 20),   # meets both
               _result(0.5, 0.010, 20),   # meets both
               _result(1.5, 0.010, 20),   # TTFT too slow
               _result(0.5, 0.020, 20),   # TPOT too slow
               _result(0.0, 0.0, 0, error="HTTP 429")]
    queue = [QueueSample(0.5, {"prefill": 3, "decode": 5}, {"prefill": 1, "decode": 4}),
             QueueSample(1.0, {"decode": 2}, {"decode": 2}),
             QueueSample(9.0, {}, {"decode": 0})]  # after every request ended: not counted
    s = summarize(cfg, RunOutcome(results, duration_s=4.0, queue=queue))
    assert s["mean_running"] == {"decode": 3.0, "prefill": 0.5}
    p = SweepPoint.from_summary(1.25, s)
    assert p.batch_mean == 3.0
    assert p.sent == 5 and p.failed == 1 and p.completed == 4
    assert p.attainment == pytest.approx(0.4) and p.goodput == pytest.approx(0.5)
    assert p.tpot_p50_ms == pytest.approx(10.0)


def test_max_rate_and_interpolation():
    pts = [_point(1, 1.0), _point(2, 0.96), _point(4, 0.86), _point(8, 0.2)]
    assert max_rate_meeting(pts, 0.9) == 2
    # 0.96 -> 0.86 between 2 and 4 req/s: 0.9 is crossed 60% of the way.
    assert interpolated_rate(pts, 0.9) == pytest.approx(3.2)
    assert max_rate_meeting(pts, 0.99) == 1 and interpolated_rate(pts, 0.99) > 1
    assert max_rate_meeting(pts[3:], 0.9) is None and interpolated_rate(pts[3:], 0.9) is None
    assert interpolated_rate(pts[:2], 0.9) == 2  # nothing measured above: the rate itself
    # A noisy dip below the target does not hide a higher rate that met it.
    noisy = [_point(1, 0.95), _point(2, 0.85), _point(3, 0.92), _point(4, 0.5)]
    assert max_rate_meeting(noisy, 0.9) == 3


def test_summary_table_json_round_trip_and_plot(tmp_path):
    pts = [_point(1, 1.0), _point(2, 0.95), _point(4, 0.5)]
    s = sweep_summary(pts, 0.9, 1000, 12, label="spatial")
    assert s["max_rate"] == 2 and s["max_goodput"] == pytest.approx(2.0)
    assert points_from_json(json.loads(json.dumps(s))) == pts
    table = format_sweep_table(s)
    assert "highest rate with >= 90% attainment: 2 req/s" in table and "spatial" in table
    assert "no measured rate" in format_sweep_table(sweep_summary(pts[2:], 0.9, 1000, 12))

    mixed = sweep_summary([_point(0.5, 0.95), _point(1, 0.5)], 0.9, 1000, 12, label="mixed-512")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "sweep_report.json").write_text(json.dumps({"sweep": s}, indent=1))
    (tmp_path / "b.jsonl").write_text("noise\n" + json.dumps({"model": "m", **mixed}) + "\n")
    got = [load_summary(str(tmp_path / "a")), load_summary(f"{tmp_path / 'b.jsonl'}=colocated")]
    assert got[0]["label"] == "spatial" and got[1]["label"] == "colocated"
    table = comparison_table(got, baseline="colocated")
    spatial_row = table.splitlines()[1].split()
    # spatial: 2 -> 3.8 interpolated; colocated: 0.5 -> 0.59 interpolated.
    assert spatial_row[0] == "spatial" and float(spatial_row[-1]) == pytest.approx(
        s["max_rate_interpolated"] / mixed["max_rate_interpolated"], abs=0.01)
    png = plot_attainment(str(tmp_path / "fig.png"), got)
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
