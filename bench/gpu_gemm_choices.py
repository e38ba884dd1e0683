#!/usr/bin/env python3
"""Our Triton GEMM (kernels/gemm.py) against cuBLAS for each Llama-3-8B layer matrix at the row
counts of a decode batch (64, 256) and of a prefill (4096), over a sweep of tile shapes and
split-K counts: plain, and for gate_up with SiLU-mul in the epilogue against cuBLAS followed by
our SiLU-mul kernel. Weights are cycled through enough copies that L2 never holds them; µs per
call inside a CUDA graph. Prints one JSON row per measurement (also to $OUT/kernel_choices.jsonl).

usage: python3 -P -m pdserve.bench.gpu_gemm_choices [--m 64,256,4096]
         [--shapes qkv,o_proj,gate_up,down]
"""

from __future__ import annotations

import argparse
import sys

import torch

from pdserve.bench.gpu_kernel_choices import SHAPES, _weights, emit, graph_time

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, num_warps, num_stages)
SWEEP = [
    (128, 256, 64, 8, 1, 8, 3), (128, 128, 64, 8, 1, 8, 4), (128, 128, 64, 8, 1, 4, 4),
    (128, 64, 64, 8, 1, 4, 4), (64, 128, 64, 8, 1, 4, 4), (64, 256, 64, 8, 1, 8, 3),
    (256, 128, 64, 8, 1, 8, 3), (128, 128, 128, 8, 1, 8, 3),
]
SPLIT_SWEEP = [(128, 128, 64, 8, s, 8, 4) for s in (2, 4)] + [(64, 128, 64, 8, s, 4, 4)
                                                            for s in (2, 4)]
# With SiLU-mul a program holds two accumulators (gate and up): BLOCK_N counts one of them.
SILU_SWEEP = [
    (256, 64, 64, 8, 1, 8, 3), (256, 64, 64, 8, 1, 8, 4), (128, 128, 64, 8, 1, 8, 3),
    (128, 128, 64, 8, 1, 8, 4), (128, 64, 64, 8, 1, 4, 4), (128, 64, 64, 8, 1, 8, 4),
    (64, 128, 64, 8, 1, 4, 4), (64, 64, 64, 8, 1, 4, 4), (256, 64, 64, 16, 1, 8, 3),
    (128, 128, 64, 16, 1, 8, 4), (128, 64, 128, 8, 1, 8, 3),
]


def one(name: str, m: int, silu: bool) -> None:
    from pdserve.kernels.gemm import gemm
    from pdserve.kernels.silu_mul import silu_mul

    n, k = SHAPES[name]
    ws = _weights(n, k)
    calls = len(ws) * 3
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    full = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * n * k

    def report(variant: str, sec: float, **extra: object) -> None:
        emit(exp="gemm", shape=name + (" +silu" if silu else ""), m=m, variant=variant,
             us=round(sec * 1e6, 2), tflops=round(flops / sec / 1e12, 1),
             gbps=round(n * k * 2 / sec / 1e9, 1), **extra)

    def cublas(i: int) -> None:
        torch.matmul(x, ws[i % len(ws)].t(), out=full)
        if silu:
            silu_mul(full)

    report("cublas" + (" + silu_mul kernel" if silu else ""), graph_time(cublas, calls))
    ref = torch.nn.functional.linear(x, ws[0]).float()
    if silu:
        g, u = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(g) * u
    best = (1.0, None)
    for cfg in SILU_SWEEP if silu else SWEEP + (SPLIT_SWEEP if m <= 256 else []):
        try:
            out = gemm(x, ws[0], silu_mul=silu, config=cfg)
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            sec = graph_time(lambda i, cfg=cfg: gemm(x, ws[i % len(ws)], silu_mul=silu,
                                                     config=cfg), calls)
        except Exception as e:  # noqa: BLE001
            report("triton", 1.0, config=cfg, error=str(e)[:200])
            continue
        report("triton", sec, config=cfg, rel_err=round(err, 5))
        best = min(best, (sec, cfg))
    report("triton best", best[0], config=best[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="64,256,4096")
    p.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    p.add_argument("--silu-only", action="store_true", help="only gate_up with SiLU-mul")
    args = p.parse_args()
    for m in (int(v) for v in args.m.split(",")):
        for name in args.shapes.split(","):
            if not args.silu_only:
                one(name, m, silu=False)
            if name == "gate_up":
                one(name, m, silu=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
