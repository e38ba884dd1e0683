"""A decode worker's step time at a batch size, as clients see it through the serving path.

B requests sent at once (same prompt and output lengths, `ignore_eos`): once the last of them
has its first token, every prefill is done and B requests decode together until the first one
finishes. The median gap between consecutive tokens in that window is one decode step at batch
B (serving overhead included, which is what an ITL is compared with). Read from the
bench_report.json of `pdserve bench --num-prompts B --max-concurrency B --output-dir DIR`.
"""

from __future__ import annotations

import statistics


def token_times(req: dict) -> list[float]:
    """Arrival times (s since the run began) of a request's tokens, from its report record."""
    t = req["start_s"] + req["ttft_ms"] / 1e3
    out = [t]
    for gap in req["itl_ms"]:
        t += gap / 1e3
        out.append(t)
    return out


def steady_step_ms(report: dict) -> tuple[float | None, int, int]:
    """(median inter-token gap while all requests decode together, batch, gaps used)."""
    reqs = [r for r in report.get("requests", []) if r.get("ok") and r.get("ttft_ms") is not None]
    if not reqs:
        return None, 0, 0
    times = [token_times(r) for r in reqs]
    all_started = max(t[0] for t in times)
    first_done = min(t[-1] for t in times)
    gaps = [(b - a) * 1e3 for t in times for a, b in zip(t, t[1:])
            if a >= all_started and b <= first_done]
    if not gaps:
        return None, len(reqs), 0
    return statistics.median(gaps), len(reqs), len(gaps)
