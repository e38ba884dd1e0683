#!/usr/bin/env python3
"""Where one decode step's GPU time goes: per-kernel CUDA time of an eager decode step on the
random-weight Llama-3-8B-shaped model (kernels grouped by name, with counts), and the host cost
of a CUDA-graph replay (replay of the bare graph vs the runner's replay with input copies and
planning).

usage: python3 -P -m pdserve.bench.gpu_profile [--backends triton,flashinfer] [--batches 1,256]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

from pdserve.bench.gpu_bench import kv_read_bytes, make_backend, timed
from pdserve.bench.gpu_harness import PagedSeqs, llama3_8b_config, random_model
from pdserve.engine.kv_pool import KVPool


def kernel_table(fn, steps: int = 3) -> list[tuple[str, int, float]]:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:90]]
            a[0] += 1
            a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = [(n, c // steps, t / steps / 1e3) for n, (c, t) in agg.items()]
    return sorted(rows, key=lambda r: -r[2])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton,flashinfer")
    p.add_argument("--batches", default="1,256")
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args()
    cfg = llama3_8b_config()
    model = random_model(cfg)
    batches = [int(b) for b in args.batches.split(",")]
    pool = KVPool(max(batches) * -(-args.context // 16) + 64, cfg.num_layers, 16,
                  cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    for name in args.backends.split(","):
        backend = make_backend(name, cfg)
        seqs = PagedSeqs(pool, backend, seed=1)
        for b in batches:
            seqs.pretend_context(b, args.context - 1)
            fb = seqs.batch([[7]] * b)

            def step(fb=fb, backend=backend) -> None:  # noqa: ANN001
                backend.init_forward(fb)
                model(fb)

            rows = kernel_table(step)
            total = sum(r[2] for r in rows)
            kv = kv_read_bytes(cfg, b, args.context) / 1e9
            print(f"\n== {name} bs={b}: {total:.3f} ms of kernel time per step "
                  f"({sum(r[1] for r in rows)} kernels); KV read {kv:.2f} GB")
            for n, c, t in rows[:14]:
                print(f"  {t:8.3f} ms  {c:5d}x  {n}")
            from pdserve.engine.cuda_graph import CudaGraphDecodeRunner

            runner = CudaGraphDecodeRunner(model, pool, backend, b)
            runner.capture()
            bucket = runner.bucket_for(b)
            full = timed(lambda r=runner, fb=fb: r.replay(fb), 20)  # also fills the inputs
            bare = timed(lambda r=runner, k=bucket: r.graphs[k].replay(), 20)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                runner.replay(fb)
            host = (time.perf_counter() - t0) / 10
            torch.cuda.synchronize()
            print(f"  graph replay bs={b}: bare {bare * 1e3:.3f} ms, with inputs and plan "
                  f"{full * 1e3:.3f} ms; host time of one replay() call {host * 1e3:.3f} ms "
                  "(queued back to back)")
            rows = kernel_table(lambda r=runner, fb=fb: r.replay(fb))
            print(f"  in the graph: {sum(r[2] for r in rows):.3f} ms of kernel time")
            for n, c, t in rows[:6]:
                print(f"  {t:8.3f} ms  {c:5d}x  {n}")
            runner.graphs.clear()
        prompt = torch.randint(0, cfg.vocab_size, (4096,)).tolist()

        def prefill(backend=backend, seqs=seqs, prompt=prompt) -> None:  # noqa: ANN001
            seqs.reset(1)
            fb = seqs.batch([prompt])
            backend.init_forward(fb)
            model(fb)

        rows = kernel_table(prefill, steps=2)
        print(f"\n== {name} prefill 4096: {sum(r[2] for r in rows):.3f} ms of kernel time")
        for n, c, t in rows[:16]:
            print(f"  {t:8.3f} ms  {c:5d}x  {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
