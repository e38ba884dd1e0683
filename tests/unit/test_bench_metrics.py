"""`pdserve bench` figures: token allocation, ITL/TPOT definitions, goodput, stage fallback."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serve_client import RequestResult, allocate_tokens
from pdserve.bench.serve_config import BenchConfig
from pdserve.bench.serve_metrics import (
    itls_ms,
    meets_slo,
    stage_breakdown,
    stats,
    summarize,
    timeline,
    tpot_ms,
)
from pdserve.bench.serve_report import format_table
from pdserve.bench.serve_runner import QueueSample, RunOutcome


def _result(times: list[float], tokens: list[int] | None = None, **kw) -> RequestResult:
    r = RequestResult(input_len=8, output_len=8, **kw)
    r.chunk_times = times
    r.chunk_tokens = tokens or [1] * len(times)
    r.end_s = times[-1] + 0.001 if times else 0.0
    return r


def test_allocate_tokens():
    assert allocate_tokens([], 5) == []
    assert allocate_tokens(["a", "b", "c"], 3) == [1, 1, 1]
    assert allocate_tokens(["a", "b"], 1) == [1, 1]  # never below one per chunk
    out = allocate_tokens(["x", "xxxxxxxx", "x"], 7)
    assert sum(out) == 7 and out[1] > out[0] and min(out) >= 1


def test_itl_splits_multi_token_chunks_and_tpot():
    r = _result([0.100, 0.110, 0.140], [1, 1, 3])
    gaps = itls_ms(r)
    assert gaps == pytest.approx([10.0, 10.0, 10.0, 10.0])  # 30 ms over 3 tokens
    assert tpot_ms(r) == pytest.approx(40.0 / 4)  # (140 - 100) ms / (5 - 1)
    assert tpot_ms(_result([0.1])) is None
    # Tokens that stream no text after the first: their time shows at the finish chunk.
    tail = _result([0.100], [1])
    tail.chunk_tokens, tail.finish_s = [256], 1.375
    assert tpot_ms(tail) == pytest.approx((1375.0 - 100.0) / 255)


def test_stats_percentiles():
    s = stats([float(i) for i in range(1, 101)])
    assert s["mean"] == pytest.approx(50.5) and s["p50"] == pytest.approx(50.5)
    assert s["p99"] == pytest.approx(99.01) and s["max"] == 100 and s["count"] == 100
    assert stats([])["count"] == 0


def test_goodput_needs_both_slos():
    cfg = BenchConfig(slo_ttft_ms=200, slo_itl_ms=20)
    fast = _result([0.1, 0.11, 0.12])
    slow_first = _result([0.3, 0.31])
    slow_tokens = _result([0.1, 0.15, 0.2])
    failed = _result([], error="HTTP 500")
    assert meets_slo(fast, cfg) and not meets_slo(slow_first, cfg)
    assert not meets_slo(slow_tokens, cfg) and not meets_slo(failed, cfg)
    out = RunOutcome([fast, slow_first, slow_tokens, failed], duration_s=2.0)
    s = summarize(cfg, out)
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == {"HTTP 500": 1}
    assert s["goodput"] == pytest.approx(0.5) and s["slo_attainment"] == pytest.approx(0.25)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["total_output_tokens"] == 3 + 2 + 3
    assert "Goodput" in format_table(cfg, s)


def test_stages_from_responses_then_metrics():
    r = _result([0.1, 0.2], timings={"queue_ms": 2.0, "prefill_ms": 5.0, "transfer_ms": 0.0})
    got = stage_breakdown([r], "", "")
    assert got["source"] == "responses" and got["stages_ms"]["prefill"]["mean"] == 5.0
    assert "transfer" in got["not_reported"] and "queue" not in got["not_reported"]
    before = ('pdserve_router_stage_seconds_sum{stage="queue"} 1.0\n'
              'pdserve_router_stage_seconds_count{stage="queue"} 10.0\n')
    after = ('pdserve_router_stage_seconds_sum{stage="queue"} 1.5\n'
             'pdserve_router_stage_seconds_count{stage="queue"} 15.0\n')
    got = stage_breakdown([_result([0.1])], before, after)
    assert got["source"] == "metrics"
    assert got["stages_ms"]["queue"] == {"mean": pytest.approx(100.0), "count": 5}
    assert stage_breakdown([_result([0.1])], "", "")["source"] == "missing"


def test_timeline_bins():
    a = _result([0.1, 0.5, 1.2], start_s=0.0)
    b = _result([0.2, 0.3], [1, 2], start_s=1.0)
    out = RunOutcome([a, b], duration_s=2.5, queue=[QueueSample(0.0, {"prefill": 1})])
    tl = timeline(out)
    assert tl["t_s"] == [0.0, 1.0, 2.0]
    assert tl["output_tok_s"] == [2.0, 4.0, 0.0]
    assert tl["requests_s"] == [0.0, 2.0, 0.0]
    assert tl["queue"] == [{"t_s": 0.0, "prefill": 1}]


@pytest.mark.parametrize("chat", [False, True])
def test_a_reply_without_text_counts_at_its_finish_chunk(chat: bool):
    """One special token decodes to no text: the stream's only choice chunk carries just the
    finish reason. That is the reply's arrival, not a request without output."""
    from pdserve.bench.serve_client import HttpBenchClient

    cfg = BenchConfig(endpoint="chat" if chat else "completions")
    client = HttpBenchClient(cfg, "m")
    choice = {"index": 0, "finish_reason": "length", "logprobs": None}
    choice.update({"delta": {}} if chat else {"text": ""})
    res, texts = RequestResult(input_len=4, output_len=1), []
    client._line("data: " + json.dumps({"choices": [choice]}), res, texts, 0.0)
    assert texts == [""] and len(res.chunk_times) == 1
    # once text came, a finish-only chunk after it is not another arrival
    res, texts = RequestResult(input_len=4, output_len=2), []
    body = {"delta": {"content": "hi"}} if chat else {"text": "hi"}
    first = {"index": 0, "finish_reason": None, **body}
    client._line("data: " + json.dumps({"choices": [first]}), res, texts, 0.0)
    assert res.finish_s == 0.0
    client._line("data: " + json.dumps({"choices": [choice]}), res, texts, 0.0)
    assert texts == ["hi"] and len(res.chunk_times) == 1
    assert res.finish_s >= res.chunk_times[0]  # the last token's arrival, for TPOT
