#!/usr/bin/env python3
"""Host time of the real decode loop (Scheduler -> ModelRunner -> CUDA graph -> sampler) on
the random-weight Llama-3-8B-shaped model: ms per step with overlap on and off, and a cProfile
of a third, overlapped run (functions by own time and by cumulative time). When the host needs
longer per step than the GPU, overlap cannot hide it: this says where that time goes.

usage: python3 -P -m pdserve.bench.gpu_loop_profile [--backend flashinfer] [--batches 1,64]
         [--steps 48]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

import torch

from pdserve.bench.gpu_bench import run_decode_loop
from pdserve.bench.gpu_harness import llama3_8b_config, random_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="flashinfer")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--top", type=int, default=28, help="functions listed per profile")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args()

    from pdserve.engine.engine import DECODE_WORKER_COLUMN_MAJOR
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.model_runner import ModelRunner, default_attention_backend
    from pdserve.engine.models.layers import set_weight_layout

    cfg = llama3_8b_config()
    model = random_model(cfg)
    set_weight_layout(model.projection_weights(), column_major=DECODE_WORKER_COLUMN_MAJOR)
    batches = [int(b) for b in args.batches.split(",")]
    ctx, steps = args.context, args.steps
    pool = KVPool(max(batches) * -(-(ctx + steps + 8) // 16) + 64, cfg.num_layers, 16,
                  cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    backend = default_attention_backend(torch.device("cuda"), args.backend,
                                        num_heads=cfg.num_heads)
    runner = ModelRunner(model, cfg, pool, backend)
    runner.enable_cuda_graph(max(batches))
    for bs in batches:
        profile_loop(runner, pool, cfg, bs, ctx, steps, args)
    return 0


def profile_loop(runner, pool, cfg, bs: int, ctx: int, steps: int, args) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (ctx - 1,), generator=gen).tolist()
               for _ in range(bs)]
    for on, profiled in ((False, False), (True, False), (True, True)):
        prof = cProfile.Profile() if profiled else None
        sec, calls, _ = run_decode_loop(runner, pool, prompts, steps, on, warm_steps=3,
                                        profiler=prof)
        per = sec / max(calls, 1)
        label = ("on" if on else "off") + (", under cProfile" if profiled else "")
        print(f"== overlap {label}: {per * 1e3:.3f} ms per step over {calls} steps "
              f"(bs={bs}, ctx={ctx}, {args.backend})", flush=True)
        if prof is not None:
            for key in ("tottime", "cumtime"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
                print(f"-- by {key} (cProfile slows the loop; shares matter, not totals)")
                print("\n".join(out.getvalue().splitlines()[6:8 + args.top]), flush=True)

if __name__ == "__main__":
    sys.exit(main())
