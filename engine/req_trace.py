"""Opt-in timestamps of one request's path through the router and the workers, for finding
where its time to first token goes between the hops.

`PDSERVE_REQ_TRACE=1` makes every process print `reqtrace <stage> <request id> <monotonic s>`
lines to stderr (CLOCK_MONOTONIC is host-wide, so the router's and the workers' stamps compare);
`pdserve reqtrace LOG` prints, per stage, the median milliseconds after the router received the
request, e.g. after `PDSERVE_REQ_TRACE=1 pdserve up ... 2> LOG` and a few requests. Off, a
stage costs one cached lookup. A worker's request id is the router's with `@room` appended; the
summary joins them. Warm-up requests are left out.
"""

from __future__ import annotations

import sys
import time

from pdserve.envs import envs

# In the order a request passes them (decode's own stages, its registration and prefill's
# bootstrap run beside the prefill, which starts before them on an idle prefill worker).
# accept: a worker took the call; queued: its scheduler took it; added: its scheduler's add()
# returned (prefill: the KV sender made); decode-accept / -queued / -added: the same on a
# decode worker; step: the scheduler's next iteration began with it waiting; scheduled: its
# extend batch was formed; registered: decode preallocated the prompt's pages; bootstrapped:
# prefill saw them; extend: its extend batch started; sampled: the prompt's first token was
# read back (prefill or mixed worker); answered: the prefill worker's session wrote its answer
# (with that token); reached: the router's session read that answer; transferred: decode has
# the KV and the first token; sent: the worker's session wrote the first token's message;
# received: the router's session read it; first: the router has the first token (in P/D from
# the prefill answer, before decode's message).
STAGES = ("arrival", "dispatch", "accept", "queued", "added", "decode-accept", "decode-queued",
          "decode-added", "step", "scheduled", "registered", "bootstrapped", "extend", "sampled",
          "answered", "reached", "transferred", "sent", "received", "first")


def enabled() -> bool:
    return envs().req_trace


def stamp(stage: str, request_id: str, at: float | None = None) -> None:
    if envs().req_trace and not request_id.startswith("warmup-"):
        t = time.monotonic() if at is None else at
        sys.stderr.write(f"reqtrace {stage} {request_id.partition('@')[0]} {t:.6f}\n")


def summarize(lines: list[str]) -> dict[str, float]:
    """Median milliseconds from `arrival` to each stage's first stamp, over the requests that
    have an arrival, in stage order."""
    from pdserve.trace_log import first_stamps, median

    at = first_stamps(lines, "reqtrace", key=lambda rid: rid.partition("@")[0], stages=STAGES)
    values: dict[str, list[float]] = {}
    for t in at.values():
        if "arrival" not in t:
            continue
        for stage, when in t.items():
            values.setdefault(stage, []).append((when - t["arrival"]) * 1e3)
    return {s: median(values[s]) for s in STAGES if s in values}


def main(argv: list[str] | None = None) -> int:
    """`pdserve reqtrace LOG`: per stage, the median ms after arrival in a PDSERVE_REQ_TRACE=1
    log, as JSON."""
    from pdserve.trace_log import summary_main

    return summary_main("pdserve reqtrace", main.__doc__, "PDSERVE_REQ_TRACE", summarize,
                        argv)


if __name__ == "__main__":
    sys.exit(main())
