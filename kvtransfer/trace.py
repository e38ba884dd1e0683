"""Opt-in stage timestamps of a room's transfer, for finding where a transfer's latency goes.

`PDSERVE_KV_TRACE=1` makes both sides print `kvtrace <stage> <room> <monotonic s>` lines to
stderr (CLOCK_MONOTONIC is host-wide, so a prefill and a decode process on one host compare);
`pdserve kvtrace LOG` prints the median time between stages, e.g. after
`PDSERVE_KV_TRACE=1 pdserve kvbench ... 2> LOG`. Off, a stage costs one cached lookup.
"""

from __future__ import annotations

import sys
import time

from pdserve.envs import envs

# In the order a one-sided chunk passes them ("mapped", "uploaded" and "kernel" inside the
# cuda_ipc write, the last two on its kernel path only). ucx stamps the chunk's start on its
# loop ("looped") and each piece of it ("issued": its gather launched, "staged": its payload
# ready to send, "header": its header at the receiver, "received": its payload there,
# "copied": its scatter launched), or with puts "issued" once each put of the chunk started
# and "staged" once they landed; then "launched" once every send is done. The receiver of a
# one-sided engine stamps "landed" as a chunk's notification reaches it. A room's summary
# takes each stage's first stamp.
STAGES = ("send", "dequeue", "looped", "mapped", "uploaded", "kernel", "issued", "staged",
          "header", "launched", "notified", "landed", "received", "copied", "success")


def stamp(stage: str, room: int) -> None:
    if envs().kv_trace:
        sys.stderr.write(f"kvtrace {stage} {room} {time.monotonic():.6f}\n")


class GpuTimer:
    """CUDA events around one chunk's copies; `done()` records the end and prints the copy
    times of earlier chunks whose events have completed (never waits on the GPU)."""

    _pending: list[tuple[int, object, object]] = []

    def __init__(self, stream: object) -> None:
        import torch

        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record(stream)

    def done(self, room: int, stream: object) -> None:
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        pending = GpuTimer._pending
        pending.append((room, self.start, end))
        while pending and pending[0][2].query():
            r, a, b = pending.pop(0)
            sys.stderr.write(f"kvtrace gpu_copy_ms {r} {a.elapsed_time(b):.4f}\n")


def gpu_timer(stream: object) -> GpuTimer | None:
    return GpuTimer(stream) if envs().kv_trace else None


def summarize(lines: list[str]) -> dict[str, float]:
    """Median milliseconds from each stage to the next one a room passed, and of the GPU copy
    times; then the same steps of the log's first room alone (`first a->b`: the first room
    to a new peer is the one that pays for whatever was not set up before it)."""
    from pdserve.trace_log import first_stamps, median

    at = first_stamps(lines, "kvtrace", key=int)
    values: dict[str, list[float]] = {}
    for t in at.values():
        for step, ms in _steps(t).items():
            values.setdefault(step, []).append(ms)
    out = {key: median(v) for key, v in values.items()}
    sent = [t for t in at.values() if "send" in t]
    if len(sent) > 1:
        first = min(sent, key=lambda t: t["send"])
        out.update({f"first {step}": round(ms, 3) for step, ms in _steps(first).items()})
    return out


def _steps(t: dict[str, float]) -> dict[str, float]:
    seen = [s for s in STAGES if s in t]
    steps = {f"{a}->{b}": (t[b] - t[a]) * 1e3 for a, b in zip(seen, seen[1:])}
    if "gpu_copy_ms" in t:
        steps["gpu_copy_ms"] = t["gpu_copy_ms"]
    return steps


def main(argv: list[str] | None = None) -> int:
    """`pdserve kvtrace LOG`: the stage medians of a PDSERVE_KV_TRACE=1 log, as JSON."""
    from pdserve.trace_log import summary_main

    return summary_main("pdserve kvtrace", main.__doc__, "PDSERVE_KV_TRACE", summarize, argv)


if __name__ == "__main__":
    sys.exit(main())
