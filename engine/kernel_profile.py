"""`PDSERVE_KERNEL_PROFILE=DIR`: what the device ran during a scheduler's long extend batches.

Every extend batch of at least `MIN_TOKENS` tokens (the first `MAX_STEPS` of a scheduler) runs
under torch.profiler. One JSON line per such step goes to `kernels-<pid>-<id>.jsonl` in DIR:
its wall time, its tokens, the time per kernel name (device time on CUDA; on a CPU, the
self time of each operator), their sum, and their span (the first kernel's start to the last
one's end: a span longer than the sum is time the device waited between kernels). Two
processes' files set side by side (`python -m pdserve.bench.kernel_profile DIR`) tell whether
one of them runs the same kernels slower (the device: clocks, a neighbour's work), runs other
ones, or leaves the device waiting between them, which a wall-clock step trace cannot tell
apart. Off, a step pays one attribute test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from pdserve.envs import envs

MIN_TOKENS = 1024
MAX_STEPS = 32


def _time_us(event: object, cuda: bool) -> float:
    names = (("self_device_time_total", "self_cuda_time_total") if cuda
             else ("self_cpu_time_total",))
    for name in names:
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


class KernelProfile:
    def __init__(self, folder: str, device: torch.device) -> None:
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"kernels-{os.getpid()}-{id(self):x}.jsonl")
        self._cuda = device.type == "cuda"
        self.steps = 0
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv,
                                "device": str(device)}) + "\n")

    @classmethod
    def from_env(cls, device: torch.device) -> KernelProfile | None:
        folder = envs().kernel_profile
        return cls(folder, device) if folder else None

    def step(self, tokens: int) -> AbstractContextManager[None]:
        """Profile the extend batch run inside it, if it is long and the budget lasts."""
        if tokens < MIN_TOKENS or self.steps >= MAX_STEPS:
            return nullcontext()
        self.steps += 1
        return self._profiled(tokens)

    @contextmanager
    def _profiled(self, tokens: int) -> Iterator[None]:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        t0 = time.perf_counter()
        with profile(activities=kinds) as prof:
            yield
            if self._cuda:
                torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        want = DeviceType.CUDA if self._cuda else DeviceType.CPU
        times: dict[str, float] = {}
        for e in prof.key_averages():
            if e.device_type == want and (us := _time_us(e, self._cuda)) > 0:
                times[e.key] = times.get(e.key, 0.0) + us / 1e3
        ranges = [e.time_range for e in prof.events() if e.device_type == want]
        span = (max(r.end for r in ranges) - min(r.start for r in ranges)) / 1e3 if ranges else 0
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), "wall_ms": wall * 1e3, "tokens": tokens,
                                "kernel_ms": round(sum(times.values()), 4),
                                "span_ms": round(span, 4),
                                "kernels": {k: round(v, 4) for k, v in times.items()}}) + "\n")
