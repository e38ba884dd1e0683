"""The host's cost of issuing a scattered room as one device copy per page: 256 copies of 2 MiB
between random pages of two pools on one GPU, each a `cuMemcpyDtoDAsync` and (as UCX's cuda_ipc
transport does per put) a `cuEventRecord`, issued from 1, 2, 4 and 8 threads, each thread on
its own stream. It is the floor under any transport that makes one operation per page, and says
whether spreading a room's puts over threads (or UCX workers) would issue them sooner.

    python3 -P -m pdserve.bench.copy_issue [--pages 256] [--page-mib 2] [--reps 30]

A row per (threads, event): the issue time (the last thread's last call, from a common start)
and issue plus copy (until the GPU finished), medians over the repetitions after five warm-up
ones. GPU only.
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

import numpy as np
import torch

_VP = ctypes.c_void_p


def _driver() -> ctypes.CDLL:
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _VP]
    cu.cuEventRecord.argtypes = [_VP, _VP]
    cu.cuEventCreate.argtypes = [ctypes.POINTER(_VP), ctypes.c_uint]
    cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(_VP)]
    cu.cuCtxSetCurrent.argtypes = [_VP]
    return cu


def _events(cu: ctypes.CDLL, n: int) -> list[_VP]:
    out = []
    for _ in range(n):
        e = _VP()
        if cu.cuEventCreate(ctypes.byref(e), 2):  # CU_EVENT_DISABLE_TIMING
            raise RuntimeError("cuEventCreate failed")
        out.append(e)
    return out


def run(cu: ctypes.CDLL, src: torch.Tensor, dst: torch.Tensor, threads: int, with_event: bool,
        pages: int, page_bytes: int, reps: int, rng: np.random.Generator) -> tuple[float, float]:
    """(issue ms, issue + copy ms), medians; `src` and `dst` are pools of whole pages."""
    ctx = _VP()
    cu.cuCtxGetCurrent(ctypes.byref(ctx))
    pool_pages = src.numel() // page_bytes
    streams = [torch.cuda.Stream() for _ in range(threads)]
    events = [_events(cu, pages) for _ in range(threads)]
    times = []
    for _ in range(reps + 5):
        s = rng.choice(pool_pages, pages, replace=False)
        d = rng.choice(pool_pages, pages, replace=False)
        jobs = [[(dst.data_ptr() + int(d[i]) * page_bytes, src.data_ptr() + int(s[i]) * page_bytes)
                 for i in range(t, pages, threads)] for t in range(threads)]
        torch.cuda.synchronize()
        start, done = threading.Barrier(threads + 1), []

        def work(t: int, jobs=jobs, start=start, done=done) -> None:
            cu.cuCtxSetCurrent(ctx)
            stream = _VP(streams[t].cuda_stream)
            start.wait()
            for k, (to, frm) in enumerate(jobs[t]):
                if cu.cuMemcpyDtoDAsync_v2(to, frm, page_bytes, stream):
                    raise RuntimeError("cuMemcpyDtoDAsync failed")
                if with_event:
                    cu.cuEventRecord(events[t][k], stream)
            done.append(time.perf_counter())

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        start.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        issued = max(done) - t0
        torch.cuda.synchronize()
        times.append((issued, time.perf_counter() - t0))
    ms = np.median(np.array(times[5:]), axis=0) * 1e3
    return float(ms[0]), float(ms[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.copy_issue", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--page-mib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a GPU")
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    page_bytes = int(args.page_mib * (1 << 20))
    rng = np.random.default_rng(0)
    cu = _driver()
    src = torch.empty(16 * args.pages * page_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    print(f"{args.pages} copies of {page_bytes >> 10} KiB, {torch.cuda.get_device_name()}")
    print("| threads | event per copy | issue ms (us per copy) | issue + copy ms (GB/s) |")
    print("| --- | --- | --- | --- |")
    for with_event in (False, True):
        for threads in (1, 2, 4, 8):
            issue, total = run(cu, src, dst, threads, with_event, args.pages, page_bytes,
                               args.reps, rng)
            gbs = args.pages * page_bytes / total / 1e6
            print(f"| {threads} | {'yes' if with_event else 'no'} | {issue:.3f} "
                  f"({issue * 1e3 / args.pages:.2f}) | {total:.3f} ({gbs:.0f}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
