#!/usr/bin/env python3
"""Where a 4096-token prefill's time goes, measured without a profiler on the GPU:

- `timeline`: CUDA events at every decoder layer's start (forward pre-hooks) and host clocks at
  the same points: GPU time before the first layer, per layer, and after the last; host time
  ahead of or behind the GPU at each point; the host functions of one prefill call by own
  time (cProfile); the prefill timed synced and back to back;
- `waves`: each Llama-3-8B layer matrix (and gate_up with SiLU-mul through kernels/gemm.py)
  at row counts around 4096: how the time steps with the number of tile waves, and our GEMM
  with its last wave split over K and not;
- `residual`: a projection followed by the residual add + RMSNorm (the add in the norm) against
  the add done by cuBLAS (`residual.addmm_`) and a norm with no residual.

usage: python3 -P -m pdserve.bench.gpu_prefill_parts [--only timeline,waves,residual]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
import torch.nn.functional as F

from pdserve.bench.gpu_bench import timed, timed_pipelined
from pdserve.bench.gpu_kernel_choices import (
    SHAPES,
    _weights,
    emit,
    graph_time,
    prefill_batch,
    run_sections,
)


def _prefill(backend_name: str = "flashinfer"):  # noqa: ANN202
    from pdserve.bench.gpu_harness import llama3_8b_config, random_model

    cfg = llama3_8b_config()
    model = random_model(cfg)
    _, backend, fb = prefill_batch(cfg, backend_name)

    def run() -> None:
        backend.init_forward(fb)
        model(fb)

    return model, run


def timeline() -> None:
    model, run = _prefill()
    n = len(model.layers)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 2)]
    host = [0.0] * (n + 2)

    def mark(i: int) -> None:
        host[i] = time.perf_counter()
        events[i].record()

    hooks = [layer.register_forward_pre_hook(lambda *_, i=i: mark(i + 1))
             for i, layer in enumerate(model.layers)]
    runs = []
    for r in range(8):
        torch.cuda.synchronize()
        mark(0)
        run()
        mark(n + 1)
        events[-1].synchronize()
        if r >= 2:
            gpu = [events[0].elapsed_time(e) for e in events]  # ms since the start
            runs.append((gpu, [(h - host[0]) * 1e3 for h in host]))
    for h in hooks:
        h.remove()
    runs.sort(key=lambda g: g[0][-1])
    gpu, hst = runs[len(runs) // 2]
    per_layer = [b - a for a, b in zip(gpu[1:n + 1], gpu[2:n + 2])]
    emit(exp="prefill_timeline", total_ms=round(gpu[-1], 3),
         before_first_layer_ms=round(gpu[1], 3),
         layer0_ms=round(per_layer[0], 3), layer1_ms=round(per_layer[1], 3),
         median_layer_ms=round(sorted(per_layer)[n // 2], 3),
         last_layer_and_head_ms=round(per_layer[-1], 3),
         host_at_layer_start_ms=[round(v, 2) for v in hst[1:6]],
         gpu_at_layer_start_ms=[round(v, 2) for v in gpu[1:6]],
         host_enqueue_total_ms=round(hst[-1], 2))
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    run()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    top = sorted(((v[2], v[3], f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}", v[1])
                  for k, v in stats.stats.items()), reverse=True)  # type: ignore[attr-defined]
    emit(exp="prefill_host_profile", by="tottime",
         top=[(round(t * 1e3, 3), round(c * 1e3, 3), f, n) for t, c, f, n in top[:25]])
    synced = timed(run, 10, warmup=2)
    back = timed_pipelined(run, 10, warmup=2)
    emit(exp="prefill_timed", synced_ms=round(synced * 1e3, 3),
         back_to_back_ms=round(back * 1e3, 3), ratio=round(synced / back, 4))
    del model
    torch.cuda.empty_cache()


def waves() -> None:
    for name in ("gate_up+silu", "qkv", "o_proj", "down"):
        n, k = SHAPES[name.split("+")[0]]
        _waves(name, _weights(n, k))
        torch.cuda.empty_cache()


def _waves(name: str, ws: list[torch.Tensor]) -> None:
    from pdserve.kernels.device import num_sms
    from pdserve.kernels.gemm import DEFAULT_CONFIG, gemm

    sms = num_sms(torch.device("cuda"))
    bm, bn = DEFAULT_CONFIG[:2]
    n, k = ws[0].shape
    for m in (3840, 3968, 4096, 4224, 4352):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        if name.endswith("silu"):
            tiles = -(-m // bm) * -(-(n // 2) // bn)
            whole = graph_time(lambda i, x=x: gemm(x, ws[i % len(ws)], silu_mul=True, sms=0),
                               len(ws) * 3)
            emit(exp="gemm_waves", shape=name, m=m, variant="last wave not split",
                 us=round(whole * 1e6, 1), waves=round(tiles / sms, 2))
            sec = graph_time(lambda i, x=x: gemm(x, ws[i % len(ws)], silu_mul=True),
                             len(ws) * 3)
        else:
            tiles = None
            sec = graph_time(lambda i, x=x, out=out: torch.matmul(x, ws[i % len(ws)].t(),
                                                                  out=out), len(ws) * 3)
        emit(exp="gemm_waves", shape=name, m=m, us=round(sec * 1e6, 1),
             us_per_1k_rows=round(sec * 1e6 * 1024 / m, 1),
             tflops=round(2 * m * n * k / sec / 1e12, 1),
             waves=round(tiles / sms, 2) if tiles else None)


def residual() -> None:
    for name in ("o_proj", "down"):
        n, k = SHAPES[name]
        _residual(name, _weights(n, k))
        torch.cuda.empty_cache()


def _residual(name: str, ws: list[torch.Tensor]) -> None:
    from pdserve.kernels.fused_norm import rmsnorm

    m = 4096
    n, k = ws[0].shape
    nw = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def w(i: int) -> torch.Tensor:
        return ws[i % len(ws)]

    variants = {
        "linear": lambda i: torch.matmul(x, w(i).t(), out=out),
        "addmm_": lambda i: res.addmm_(x, w(i).t()),
        "linear + add-norm": lambda i: rmsnorm(F.linear(x, w(i)), nw, 1e-5, res),
        "addmm_ + norm": lambda i: rmsnorm(res.addmm_(x, w(i).t()), nw, 1e-5),
        "add-norm": lambda i: rmsnorm(out, nw, 1e-5, res),
        "norm": lambda i: rmsnorm(res, nw, 1e-5),
    }
    for v, fn in variants.items():
        res.normal_()
        emit(exp="residual", shape=name, m=m, variant=v,
             us=round(graph_time(fn, len(ws) * 3) * 1e6, 1))


def main() -> int:
    return run_sections(__doc__, {"timeline": timeline, "waves": waves, "residual": residual},
                        "timeline,waves,residual")


if __name__ == "__main__":
    sys.exit(main())
