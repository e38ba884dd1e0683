"""`pdserve bench` figures from the raw results.

Definitions (all in ms):
- TTFT: request sent -> first chunk with output text (or token ids, gRPC).
- ITL: every gap between consecutive output chunks; a chunk carrying k tokens after a gap g
  counts as k gaps of g/k, so there is one ITL per generated token after the first chunk's
  (the same convention as the router's own ITL histogram and SGLang's bench_serving).
- TPOT: per request, (last chunk - first chunk) / (output tokens - 1).
- E2E: request sent -> stream closed.
- Goodput (DistServe): requests per second that met both SLOs, TTFT <= --slo-ttft and
  TPOT <= --slo-itl (a request's mean inter-token latency).
Per-stage timings are the router's (`pdserve.choices[].timings` on the final usage chunk, or
gRPC's last message); without them, means come from the /metrics stage histograms' deltas.
"""

from __future__ import annotations

import re

import numpy as np

from pdserve.bench.serve_client import RequestResult
from pdserve.bench.serve_config import BenchConfig
from pdserve.bench.serve_runner import RunOutcome

STAGES = ("queue", "bootstrap", "prefill", "transfer", "decode", "ttft")
_ROOM = re.compile(r"\d{6,}")
_STAGE_LINE = re.compile(r'^pdserve_router_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$')


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(a.max()), "count": int(a.size)}


def ttft_ms(r: RequestResult) -> float:
    return r.chunk_times[0] * 1e3


def itls_ms(r: RequestResult) -> list[float]:
    out: list[float] = []
    for k in range(1, len(r.chunk_times)):
        n = max(1, r.chunk_tokens[k] if k < len(r.chunk_tokens) else 1)
        out += [(r.chunk_times[k] - r.chunk_times[k - 1]) * 1e3 / n] * n
    return out


def output_tokens(r: RequestResult) -> int:
    return sum(r.chunk_tokens) if r.chunk_tokens else len(r.chunk_times)


def tpot_ms(r: RequestResult) -> float | None:
    """(last token - first token) / (tokens - 1). The last token arrives with the finish
    reason, which comes even when its tokens streamed no text (a text-less tail would
    otherwise make the decode look instant)."""
    n = output_tokens(r)
    if n < 2:
        return None
    return (max(r.chunk_times[-1], r.finish_s) - r.chunk_times[0]) * 1e3 / (n - 1)


def meets_slo(r: RequestResult, cfg: BenchConfig) -> bool:
    tpot = tpot_ms(r)
    return r.ok and ttft_ms(r) <= cfg.slo_ttft_ms and (tpot is None or tpot <= cfg.slo_itl_ms)


def stage_breakdown(ok: list[RequestResult], before: str, after: str) -> dict:
    """Per-stage stats from the responses; /metrics histogram means when none carried them."""
    timed = [r.timings for r in ok if r.timings]
    if timed:
        per = {s: [float(t.get(f"{s}_ms", 0.0)) for t in timed] for s in STAGES}
        # A stage that is 0 in every response was not measured by any worker on this path.
        return {"source": "responses", "count": len(timed),
                "stages_ms": {s: stats(v) for s, v in per.items()},
                "not_reported": [s for s, v in per.items() if not any(v)]}
    b, a = _parse_stage_metrics(before), _parse_stage_metrics(after)
    means = {}
    for s in STAGES:
        n = a.get(("count", s), 0.0) - b.get(("count", s), 0.0)
        total = a.get(("sum", s), 0.0) - b.get(("sum", s), 0.0)
        if n > 0:
            means[s] = {"mean": total * 1e3 / n, "count": int(n)}
    return {"source": "metrics" if means else "missing", "stages_ms": means,
            "not_reported": [s for s in STAGES if s not in means]}


def _parse_stage_metrics(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in text.splitlines():
        m = _STAGE_LINE.match(line.strip())
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def timeline(outcome: RunOutcome, bin_s: float = 1.0) -> dict:
    """Output tokens/s and finished requests/s per `bin_s` bin, plus the /workers samples."""
    num_bins = max(1, int(np.ceil(outcome.duration_s / bin_s)))
    tokens = np.zeros(num_bins)
    done = np.zeros(num_bins)
    for r in outcome.results:
        for t, n in zip(r.chunk_times, r.chunk_tokens or [1] * len(r.chunk_times)):
            tokens[min(num_bins - 1, int((r.start_s + t) / bin_s))] += n
        if r.ok:
            done[min(num_bins - 1, int((r.start_s + r.end_s) / bin_s))] += 1
    return {"bin_s": bin_s, "t_s": [i * bin_s for i in range(num_bins)],
            "output_tok_s": (tokens / bin_s).tolist(), "requests_s": (done / bin_s).tolist(),
            "queue": [{"t_s": q.t_s, **q.depth} for q in outcome.queue]}


def summarize(cfg: BenchConfig, outcome: RunOutcome) -> dict:
    results = outcome.results
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    errors: dict[str, int] = {}
    for r in failed:
        key = _ROOM.sub("N", r.error or "unknown")  # rooms / request ids would split groups
        errors[key] = errors.get(key, 0) + 1
    dur = max(outcome.duration_s, 1e-9)
    n_in = sum(r.prompt_tokens or r.input_len for r in ok)
    n_out = sum(output_tokens(r) for r in ok)
    good = sum(1 for r in ok if meets_slo(r, cfg))
    tpots = [t for t in (tpot_ms(r) for r in ok) if t is not None]
    return {
        "completed": len(ok), "failed": len(failed),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "duration_s": outcome.duration_s,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / dur,
        "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
        "goodput": good / dur,
        "slo_attainment": good / len(results) if results else 0.0,
        "slo": {"ttft_ms": cfg.slo_ttft_ms, "itl_ms": cfg.slo_itl_ms},
        "ttft_ms": stats([ttft_ms(r) for r in ok]),
        "itl_ms": stats([g for r in ok for g in itls_ms(r)]),
        "tpot_ms": stats(tpots),
        "e2e_ms": stats([r.end_s * 1e3 for r in ok]),
        "stages": stage_breakdown(ok, outcome.metrics_before, outcome.metrics_after),
        "max_queue_depth": _max_depth(outcome),
        "mean_running": _mean_running(outcome),
    }


def _max_depth(outcome: RunOutcome) -> dict[str, int]:
    out: dict[str, int] = {}
    for q in outcome.queue:
        for role, n in q.depth.items():
            out[role] = max(out.get(role, 0), n)
    return out


def _mean_running(outcome: RunOutcome) -> dict[str, float]:
    """Per role, the running requests (its batch) averaged over the /workers samples taken
    while any request of the run was still open."""
    ends = [r.start_s + r.end_s for r in outcome.results]
    last = max(ends) if ends else 0.0
    samples = [q for q in outcome.queue if q.t_s <= last] or outcome.queue
    roles = {role for q in samples for role in q.running}
    return {role: sum(q.running.get(role, 0) for q in samples) / len(samples)
            for role in sorted(roles)}
