#!/usr/bin/env python3
"""Which kernel variant is fastest for each shape of the Llama-3-8B decode and prefill paths,
measured on the GPU in one run (the choices the engine makes are checked against these):

- linear layers at M = 1 / 8 / 64 / 256 rows (and 4096, prefill, but for lm_head): F.linear on
  the [N, K] weight and a matmul on a [K, N] copy (= a column-major weight), each with cuBLAS
  and with cuBLASLt preferred; weights cycled through enough copies that L2 (50 MB on an H200)
  never holds them;
- decode attention over the 32 layers of a paged pool, context 1k at batch 1 / 8 / 64 / 256,
  2k and 4k at batch 1, 2k at batch 8, and one 32k sequence among 1k ones at batch 64 / 256:
  FlashInfer with and without tensor cores, our Triton split-KV kernel at several split counts
  (up to batch 8 also with the V load issued early), our work-list kernel; FlashInfer's other
  decode variants (`decode_variants`); our split-KV kernel alone at batch 1 and 8 over 1k / 2k
  / 4k contexts, by split count, V load order and KV tokens per step (`decode_small`, no
  FlashInfer); how fast HBM can be read at all (`read`);
- prefill attention over 4096 tokens: FlashInfer paged and ragged, backends auto / fa2 / fa3;
- a whole 4096-token prefill (row- and column-major weights): host time of planning and of
  enqueueing against GPU time, kernel time by kernel, and the idle gaps between GPU operations;
- the batch-1 GEMV kernels (kernels/gemv.py) per layer matrix against cuBLAS / cuBLASLt, over a
  sweep of block shapes and warps, plain and with their fused prologues / epilogues.

usage: python3 -P -m pdserve.bench.gpu_kernel_choices
    [--only linear,decode,prefill,prefill_model,gemv,read,decode_variants,decode_small]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from pdserve.bench.gpu_bench import make_backend, timed

OUT = os.environ.get("OUT")


def emit(**row: object) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if OUT:
        with open(os.path.join(OUT, "kernel_choices.jsonl"), "a") as f:
            f.write(line + "\n")


def graph_time(fn, calls: int, reps: int = 7) -> float:  # noqa: ANN001
    """Seconds per call of `fn(i)` for i in range(calls), captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    del g
    return sorted(times)[len(times) // 2]


SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}


def linear_choices() -> None:
    dt = torch.bfloat16
    for name, (n, k) in SHAPES.items():
        wbytes = n * k * 2
        copies = max(2, -(-400_000_000 // wbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        for m in (1, 8, 64, 256) if name == "lm_head" else (1, 8, 64, 256, 4096):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            out = torch.empty(m, n, device="cuda", dtype=dt)
            calls = copies * 3
            variants = {
                "linear": lambda i, x=x, ws=ws, out=out: torch.matmul(x, ws[i % len(ws)].t(),
                                                                      out=out),
                "mm_kn": lambda i, x=x, wts=wts, out=out: torch.matmul(x, wts[i % len(wts)],
                                                                       out=out),
            }
            res = {}
            for vname, fn in variants.items():
                res[vname] = graph_time(fn, calls)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                res["linear_lt"] = graph_time(variants["linear"], calls)
                res["mm_kn_lt"] = graph_time(variants["mm_kn"], calls)
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            ref = F.linear(x, ws[0])
            torch.matmul(x, wts[0], out=out)
            err = float((out.float() - ref.float()).abs().max())
            for vname, sec in res.items():
                emit(exp="linear", shape=name, m=m, variant=vname, us=round(sec * 1e6, 2),
                     gbps=round(wbytes / sec / 1e9, 1),
                     tflops=round(2 * m * n * k / sec / 1e12, 1), max_diff_vs_linear=err)

        torch.cuda.empty_cache()


def _weights(n: int, k: int) -> list[torch.Tensor]:
    """Enough row-major copies of an [N, K] bf16 weight that cycling them defeats L2."""
    copies = max(2, -(-400_000_000 // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def gemv_choices() -> None:
    for name, (n, k) in SHAPES.items():
        _gemv_shape(name, n, k)
        torch.cuda.empty_cache()
    _qkv_choices()
    torch.cuda.empty_cache()


def _gemv_shape(name: str, n: int, k: int) -> None:
    from pdserve.kernels.gemv import default_blocks, gemv

    dt = torch.bfloat16
    sweep = [(bn, bk, nw) for bn in (4, 8, 16) for bk in (128, 256) for nw in (4, 8)]
    ws = _weights(n, k)
    calls, wbytes = len(ws) * 3, n * k * 2
    x = torch.randn(1, k, device="cuda", dtype=dt)

    def report(variant: str, sec: float, **extra: object) -> None:
        emit(exp="gemv", shape=name, variant=variant, us=round(sec * 1e6, 2),
             gbps=round(wbytes / sec / 1e9, 1), **extra)

    out = torch.empty(1, n, device="cuda", dtype=dt)

    def cublas(i: int) -> None:
        torch.matmul(x, ws[i % len(ws)].t(), out=out)

    report("cublas", graph_time(cublas, calls))
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        report("cublaslt", graph_time(cublas, calls))
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    err = float((gemv(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max())
    report("triton default", graph_time(lambda i: gemv(x, ws[i % len(ws)]), calls),
           blocks=default_blocks(n, ws[0]), max_diff_vs_linear=err)
    g = torch.ones(k, device="cuda", dtype=dt)
    res = torch.randn(1, n, device="cuda", dtype=dt)
    # What the decode path fuses into each matrix (kernels/gemv.py, engine/models/decode_gemv).
    fused = {"o_proj": {"residual": res}, "down": {"residual": res},
             "gate_up": {"norm_weight": g, "eps": 1e-5, "silu_mul": True},
             "lm_head": {"norm_weight": g, "eps": 1e-5, "out_dtype": torch.float32}}.get(name)
    # Swept: the variant the decode path runs (qkv's runs as qkv_rope_store, swept below).
    for label, kw in (("", {}), (", as fused in decode", fused)):
        if (kw is None) or (fused is not None and not label):
            continue
        if label:
            report(f"triton default{label}", graph_time(
                lambda i, kw=kw: gemv(x, ws[i % len(ws)], **kw), calls))
        best = (1.0, None)
        for cfg in sweep:
            sec = graph_time(lambda i, cfg=cfg, kw=kw: gemv(x, ws[i % len(ws)], blocks=cfg,
                                                            **kw), calls)
            best = min(best, (sec, cfg))
        report(f"triton best of sweep{label}", best[0], config=best[1])
    report("triton default, no PDL",
           graph_time(lambda i: gemv(x, ws[i % len(ws)], pdl=False), calls))
    col = [w.t().contiguous().t() for w in ws[:2]]
    report("triton default, column-major", graph_time(lambda i: gemv(x, col[i % 2]), 6))


def _qkv_choices() -> None:
    from pdserve.kernels.gemv import default_head_block, qkv_rope_store

    n, k = SHAPES["qkv"]
    ws = _weights(n, k)
    calls, wbytes = len(ws) * 3, n * k * 2
    dt = torch.bfloat16
    x, g = torch.randn(1, k, device="cuda", dtype=dt), torch.ones(k, device="cuda", dtype=dt)
    cos, sin = torch.rand(1, 64, device="cuda"), torch.rand(1, 64, device="cuda")
    cache = torch.zeros(64, 2, 16, 8, 128, device="cuda", dtype=dt)
    slot = torch.tensor([37], device="cuda")

    def run(i: int, blocks=None) -> torch.Tensor:  # noqa: ANN001
        return qkv_rope_store(x, ws[i % len(ws)], None, g, 1e-5, cos, sin, cache[:, 0],
                              cache[:, 1], slot, 32, 8, blocks=blocks)

    sec = graph_time(run, calls)
    emit(exp="gemv", shape="qkv+norm+rope+store", variant="triton default",
         blocks=default_head_block(64, k), us=round(sec * 1e6, 2),
         gbps=round(wbytes / sec / 1e9, 1))
    best = (1.0, None)
    for bd in (2, 4, 8, 16, 32, 64):
        for bk in (128, 256, 512):
            for nw in (4, 8):
                if 2 * bd * bk <= 16384:
                    sec = graph_time(lambda i, b=(bd, bk, nw): run(i, b), calls)
                    best = min(best, (sec, (bd, bk, nw)))
    emit(exp="gemv", shape="qkv+norm+rope+store", variant="triton best of sweep",
         config=best[1], us=round(best[0] * 1e6, 2), gbps=round(wbytes / best[0] / 1e9, 1))


def read_ceiling() -> None:
    """How fast HBM can be read at all: a 4 GiB device copy (bytes read + written, the
    roofline's baseline), torch.sum (read only) and a Triton read-only kernel over a grid of
    programs, block sizes and warps; and a fill (write only)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        base = pid.to(tl.int64) * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0,
                           eviction_policy="evict_first").to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc))

    n = 2 << 30  # bf16 elements: 4 GiB
    x = torch.randn(n // 1024, 1024, device="cuda", dtype=torch.bfloat16).view(-1)
    y = torch.empty_like(x)
    nbytes = n * 2
    for name, fn, moved in (("copy", lambda: y.copy_(x), 2 * nbytes),
                            ("fill", lambda: y.fill_(1.0), nbytes),
                            ("torch_sum", lambda: x.sum(), nbytes)):
        sec = timed(fn, 10, warmup=2)
        emit(exp="read_ceiling", variant=name, tbps=round(moved / sec / 1e12, 3))
    for block, warps, iters in ((4096, 8, 16), (8192, 8, 16), (8192, 16, 8), (16384, 16, 8),
                                (4096, 4, 64), (8192, 8, 64)):
        progs = -(-n // (block * iters))
        out = torch.empty(progs, device="cuda", dtype=torch.float32)
        fn = lambda b=block, w=warps, it=iters, g=progs, o=out: _read[(g,)](  # noqa: E731
            x, o, n, BLOCK=b, ITERS=it, num_warps=w)
        sec = timed(fn, 10, warmup=2)
        emit(exp="read_ceiling", variant=f"triton_b{block}_w{warps}_i{iters}",
             tbps=round(nbytes / sec / 1e12, 3))


DECODE = dict(layers=32, hq=32, hk=8, d=128, ps=16)  # Llama-3-8B's attention, page 16


def _decode_batches(cases: list[list[int]]) -> Iterator[tuple]:
    """(lens, fb, q, views, ws) per case (one list of context lengths each) over one random
    paged pool of the Llama-3-8B attention shape; views are the 32 layers' (K, V)."""
    from pdserve.bench.gpu_harness import PagedSeqs
    from pdserve.engine.attention.triton_backend import TritonAttentionBackend
    from pdserve.engine.kv_pool import KVPool

    c = DECODE
    pages = max(sum(-(-n // c["ps"]) for n in lens) for lens in cases) + 64
    pool = KVPool(pages, c["layers"], c["ps"], c["hk"], c["d"], torch.bfloat16, "cuda")
    pool.buffer.normal_()
    seqs = PagedSeqs(pool, TritonAttentionBackend("cuda"), seed=1)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    views = [(pool.k_view(i), pool.v_view(i)) for i in range(c["layers"])]
    for lens in cases:
        seqs.pretend_context(len(lens), [n - 1 for n in lens])
        fb = seqs.batch([[7]] * len(lens))
        q = torch.randn(len(lens), c["hq"], c["d"], device="cuda", dtype=torch.bfloat16)
        yield lens, fb, q, views, ws


def _flashinfer_decode(ws, fb, tensor_cores: bool = True, **plan_kw):  # noqa: ANN001, ANN202
    """FlashInfer's decode wrapper planned for `fb` (bf16, DECODE's shape)."""
    import flashinfer

    from pdserve.engine.attention.flashinfer_backend import page_tables

    c = DECODE
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    w.plan(*page_tables(fb, torch.device("cuda")), c["hq"], c["hk"], c["d"], c["ps"],
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=c["d"] ** -0.5,
           **plan_kw)
    return w


def _worklist_pass(q, views, fb):  # noqa: ANN001, ANN202
    """run(i) for layer i of a pass through the work-list kernel: one plan per pass (at layer
    0), as the engine makes it."""
    from pdserve.kernels.decode_worklist import (
        decode_attention_worklist,
        decode_plan,
        worklist_config,
    )

    bs = q.shape[0]
    cfg = worklist_config(bs)
    plans = []

    def run(i: int) -> torch.Tensor:
        if i == 0:
            plans[:] = [decode_plan(fb.kv_indptr, bs, cfg["target_items"], cfg["block_n"])]
        return decode_attention_worklist(q, *views[i], fb.kv_indptr, fb.kv_indices,
                                         q.shape[-1] ** -0.5, plans[0],
                                         num_stages=cfg["num_stages"])
    return run


def _kv_tbps(lens: list[int], sec_per_layer: float) -> float:
    c = DECODE
    return round(sum(lens) * 2 * c["hk"] * c["d"] * 2 / sec_per_layer / 1e12, 3)


def decode_choices() -> None:
    """Decode attention over the 32 layers of a paged pool, context 1k at batch 1 / 8 / 64 /
    256, and one sequence of 32k among sequences of 1k at batch 64 / 256: FlashInfer with and
    without tensor cores, our split-KV kernel at several split counts (* = the default) and our
    work-list kernel (worklist_config)."""
    from pdserve.kernels.decode_attention import split_kv_config
    from pdserve.kernels.device import num_sms

    sms = num_sms(torch.device("cuda"))
    cases = [[1024] * b for b in (1, 8, 64, 256)]
    cases += [[1024] * 63 + [32768], [1024] * 255 + [32768], [2048], [4096], [2048] * 8]
    for lens, fb, q, views, ws in _decode_batches(cases):
        bs = len(lens)

        def flashinfer(tc: bool, fb=fb, ws=ws, q=q, views=views):  # noqa: ANN001, ANN202
            w = _flashinfer_decode(ws, fb, tc)  # planned now: the wrappers share `ws`
            return lambda i: w.run(q, views[i])

        makers = {f"flashinfer_tc{int(tc)}": partial(flashinfer, tc) for tc in (True, False)}
        default, default_n = split_kv_config(bs, DECODE["hk"], sms)
        makers[f"triton_s{default}_n{default_n}*"] = partial(
            _split_kv_run, q, views, fb, num_splits=default, block_n=default_n)
        for splits in (4, 8, 16, 32):  # 64-token steps
            makers[f"triton_s{splits}"] = partial(_split_kv_run, q, views, fb, num_splits=splits)
        if bs <= 8:  # latency-bound: the V load issued before the score matmul
            makers["triton_s32_early_v"] = partial(_split_kv_run, q, views, fb, num_splits=32,
                                                   early_v=True)
        makers["triton_worklist"] = partial(_worklist_pass, q, views, fb)
        ref = None
        for name, make in makers.items():
            run = make()
            out = run(0)
            ref = out if ref is None else ref
            diff = float((out.float() - ref.float()).abs().max())
            sec = graph_time(run, DECODE["layers"], reps=5)
            emit(exp="decode_attn", bs=bs, lens=(f"{lens[0] // 1024}k" if len(set(lens)) == 1
                                                  else "one 32k"),
                 variant=name, us_per_layer=round(sec * 1e6, 2), kv_tbps=_kv_tbps(lens, sec),
                 max_diff=diff)


def decode_small() -> None:
    """Our split-KV decode kernel at batch 1 and 8, contexts 1k / 2k / 4k: split counts 8 to
    64 (* = default), the V load early or not, 32 or 64 KV tokens per step."""
    from pdserve.kernels.decode_attention import split_kv_config
    from pdserve.kernels.device import num_sms

    sms = num_sms(torch.device("cuda"))
    cases = [[n] * b for b in (1, 8) for n in (1024, 2048, 4096)]
    for lens, fb, q, views, _ws in _decode_batches(cases):
        default, default_n = split_kv_config(len(lens), DECODE["hk"], sms)
        ref = None
        for splits in (8, 16, 32, 64):
            for early_v in (False, True):
                for block_n in (32, 64):
                    run = _split_kv_run(q, views, fb, num_splits=splits, early_v=early_v,
                                        block_n=block_n)
                    out = run(0)
                    ref = out if ref is None else ref
                    sec = graph_time(run, DECODE["layers"], reps=5)
                    emit(exp="decode_small", bs=len(lens), lens=f"{lens[0] // 1024}k",
                         splits=splits, default=(splits, block_n) == (default, default_n),
                         early_v=early_v, block_n=block_n, us_per_layer=round(sec * 1e6, 2),
                         kv_tbps=_kv_tbps(lens, sec),
                         max_diff=float((out.float() - ref.float()).abs().max()))


def _split_kv_run(q, views, fb, **kw):  # noqa: ANN001, ANN003, ANN202
    """run(i): our split-KV decode kernel over layer i's (K, V) views, with `kw`."""
    from pdserve.kernels.decode_attention import decode_attention

    return lambda i: decode_attention(q, *views[i], fb.kv_indptr, fb.kv_indices,
                                      DECODE["d"] ** -0.5, **kw)


def decode_variants() -> None:
    """FlashInfer decode attention at batch 64 / 256, context 1k, over the 32 layers of a
    paged pool: the tensor-core wrapper as used, without split-KV, with a fixed split size,
    and the prefill wrappers (FA2 / FA3) with one query per request."""
    import flashinfer

    from pdserve.engine.attention.flashinfer_backend import page_tables

    c = DECODE
    for lens, fb, q, views, ws in _decode_batches([[1024] * 64, [1024] * 256]):
        bs = len(lens)
        runs = {}
        for vname, extra in (("tc", {}), ("tc_nosplit", {"disable_split_kv": True}),
                             ("tc_split16", {"fixed_split_size": 16}),
                             ("tc_split32", {"fixed_split_size": 32})):
            runs[vname] = partial(_flashinfer_decode, ws, fb, True, **extra)
        indptr, idx, last = page_tables(fb, torch.device("cuda"))
        for backend in ("fa2", "fa3"):
            def prefill(backend=backend, ws=ws, bs=bs, indptr=indptr, idx=idx,  # noqa: ANN001, ANN202
                        last=last):
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                w.plan(torch.arange(bs + 1, dtype=torch.int32), indptr, idx, last, c["hq"],
                       c["hk"], c["d"], c["ps"], causal=False, q_data_type=torch.bfloat16,
                       kv_data_type=torch.bfloat16, sm_scale=c["d"] ** -0.5)
                return w
            runs[f"prefill_{backend}"] = prefill
        ref = None
        for vname, make in runs.items():
            try:
                w = make()
                o = w.run(q, views[0])
                ref = o if ref is None else ref
                sec = graph_time(lambda i, w=w, q=q, views=views: w.run(q, views[i]),
                                 c["layers"])
                emit(exp="decode_variant", bs=bs, variant=vname, us_per_layer=round(sec * 1e6, 2),
                     kv_tbps=_kv_tbps(lens, sec),
                     max_diff=float((o.float() - ref.float()).abs().max()))
            except Exception as e:  # noqa: BLE001
                emit(exp="decode_variant", bs=bs, variant=vname, error=str(e)[:300])


def prefill_choices() -> None:
    import flashinfer

    from pdserve.engine.kv_pool import KVPool

    t, hq, hk, d, ps = 4096, 32, 8, 128, 16
    pool = KVPool(t // ps + 64, 1, ps, hk, d, torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(0)
    pages = (torch.randperm(pool.num_pages - 1, generator=gen)[: t // ps] + 1).to(torch.int32)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = pool.k_view(0), pool.v_view(0)
    kc[pages.long()] = k.view(t // ps, ps, hk, d)
    vc[pages.long()] = v.view(t // ps, ps, hk, d)
    flops = 2 * 2 * hq * d * t * (t + 1) / 2
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    qo = torch.tensor([0, t], dtype=torch.int32)
    ref = None
    for kind in ("paged", "ragged"):
        for backend in ("auto", "fa2", "fa3"):
            t0 = time.perf_counter()
            try:
                if kind == "paged":
                    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                    w.plan(qo, torch.tensor([0, t // ps], dtype=torch.int32), pages.cuda(),
                           torch.tensor([ps], dtype=torch.int32), hq, hk, d, ps, causal=True,
                           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                           sm_scale=d**-0.5)
                    fn = lambda w=w: w.run(q, (kc, vc))  # noqa: E731
                else:
                    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
                    w.plan(qo, qo, hq, hk, d, causal=True, q_data_type=torch.bfloat16,
                           kv_data_type=torch.bfloat16, sm_scale=d**-0.5)
                    fn = lambda w=w: w.run(q, k, v)  # noqa: E731
                o = fn()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                sec = timed(fn, 10, warmup=2)
                ref = o if ref is None else ref
                emit(exp="prefill_attn", kind=kind, backend=backend,
                     chosen=str(getattr(w, "_backend", "?")), ms=round(sec * 1e3, 3),
                     tflops=round(flops / sec / 1e12, 1), first_call_s=round(first, 1),
                     max_diff=float((o.float() - ref.float()).abs().max()))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                emit(exp="prefill_attn", kind=kind, backend=backend, error=str(e)[:300])
    _sdpa_choices(q, k, v, ref, flops)


def _sdpa_choices(q, k, v, ref, flops: float) -> None:  # noqa: ANN001
    """torch SDPA over the same 4096 tokens, per backend, with the [T, H, D] <-> [1, H, T, D]
    layout changes counted (cuDNN gets K/V expanded to the query heads)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t, hq, d = q.shape
    group = hq // k.shape[1]
    qh = q.view(1, t, hq, d).transpose(1, 2)
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        def fn(backend=backend, name=name):  # noqa: ANN001, ANN202
            if name == "cudnn":
                kh = k.repeat_interleave(group, dim=1).view(1, t, hq, d).transpose(1, 2)
                vh = v.repeat_interleave(group, dim=1).view(1, t, hq, d).transpose(1, 2)
                gqa = {}
            else:
                kh = k.view(1, t, -1, d).transpose(1, 2)
                vh = v.view(1, t, -1, d).transpose(1, 2)
                gqa = {"enable_gqa": True}
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, **gqa)
            return o.transpose(1, 2).reshape(t, hq, d)
        try:
            o = fn()
            sec = timed(fn, 10, warmup=2)
            emit(exp="prefill_attn", kind="sdpa", backend=name, ms=round(sec * 1e3, 3),
                 tflops=round(flops / sec / 1e12, 1),
                 max_diff=float((o.float() - ref.float()).abs().max()))
        except Exception as e:  # noqa: BLE001
            emit(exp="prefill_attn", kind="sdpa", backend=name, error=str(e)[:300])


def gaps(fn, name: str, layout: str) -> None:  # noqa: ANN001
    """Idle time between consecutive GPU operations of one call of `fn`: total and largest;
    and the host time from the call's start to its first GPU operation (idle GPU time that a
    CUDA-event timing of the call counts), with the longest host ops in it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = list(prof.events())
    ev = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in events
                if e.device_type == cuda)
    holes = [(b[0] - a[1], a[2], b[2]) for a, b in zip(ev, ev[1:]) if b[0] > a[1]]
    host = [e for e in events if e.device_type != cuda]
    first_gpu = ev[0][0]
    start = min(e.time_range.start for e in host) if host else first_gpu
    before = sorted(((e.time_range.end - e.time_range.start, e.name[:60]) for e in host
                     if e.time_range.start < first_gpu), reverse=True)[:8]
    emit(exp="prefill_gaps", backend=name, weights=layout, ops=len(ev),
         span_ms=round((ev[-1][1] - ev[0][0]) / 1e3, 2),
         idle_ms=round(sum(h[0] for h in holes) / 1e3, 3),
         host_before_first_gpu_op_ms=round((first_gpu - start) / 1e3, 3),
         longest_host_ops_before_it=[(round(d, 1), n) for d, n in before],
         largest=[(round(h[0], 1), h[1], h[2]) for h in sorted(holes, reverse=True)[:8]])


def prefill_batch(cfg, backend_name: str, pool=None):  # noqa: ANN001, ANN201
    """(pool, backend, fb): a fresh 4096-token sequence on shuffled pages of `pool` (made for
    it when None), as one extend batch for `backend_name`."""
    from pdserve.bench.gpu_harness import PagedSeqs
    from pdserve.engine.kv_pool import KVPool

    if pool is None:
        pool = KVPool(4096 // 16 + 64, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                      torch.bfloat16, "cuda")
    backend = make_backend(backend_name, cfg)
    seqs = PagedSeqs(pool, backend, seed=2)
    seqs.reset(1)
    return pool, backend, seqs.batch([list(range(4096))])


def prefill_model() -> None:
    """Host time of planning and of enqueueing a 4096-token prefill against its GPU time, and
    the kernel time by kernel: where the gaps between kernels come from."""
    from pdserve.bench.gpu_harness import llama3_8b_config, random_model
    from pdserve.bench.gpu_profile import kernel_table
    from pdserve.engine.models.layers import set_weight_layout

    cfg = llama3_8b_config()
    model = random_model(cfg)
    pool = None
    for name, layout in (("flashinfer", "row"), ("flashinfer-planned-first", "row")):
        set_weight_layout(model.projection_weights(), column_major=layout == "column")
        pool, backend, fb = prefill_batch(cfg, name.split("-")[0], pool)
        if name.endswith("planned-first"):
            backend.lazy_extend_plan = False

        def run(fb=fb, backend=backend) -> None:  # noqa: ANN001
            backend.init_forward(fb)
            model(fb)

        gpu = timed(run, 5, warmup=2)
        host = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            backend.init_forward(fb)
            t1 = time.perf_counter()
            model(fb)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            host.append((t1 - t0, t2 - t1, time.perf_counter() - t0))
        host.sort(key=lambda h: h[2])
        plan_s, enqueue_s, wall_s = host[len(host) // 2]
        rows = kernel_table(run)
        kernel_ms = sum(r[2] for r in rows)
        gaps(run, name, layout)
        emit(exp="prefill_model", backend=name, weights=layout, gpu_ms=round(gpu * 1e3, 2),
             plan_host_ms=round(plan_s * 1e3, 2), enqueue_host_ms=round(enqueue_s * 1e3, 2),
             wall_ms=round(wall_s * 1e3, 2), kernel_ms=round(kernel_ms, 2),
             kernels=sum(r[1] for r in rows))
        for n, c, ms in rows[:16]:
            emit(exp="prefill_kernels", backend=name, weights=layout, kernel=n, count=c,
                 ms=round(ms, 3))

    torch.cuda.empty_cache()


def run_sections(doc: str, fns: dict[str, Callable[[], None]], default: str) -> int:
    """The command line of a measuring script: `--only` picks sections of `fns`, each run in
    turn with its time printed; a section that fails prints its traceback and the rest go on."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--only", default=default)
    args = p.parse_args()
    for name in args.only.split(","):
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            fns[name]()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        print(f"== {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def main() -> int:
    return run_sections(__doc__, {
        "linear": linear_choices, "decode": decode_choices, "prefill": prefill_choices,
        "prefill_model": prefill_model, "gemv": gemv_choices, "read": read_ceiling,
        "decode_variants": decode_variants, "decode_small": decode_small},
        "linear,decode,prefill_model,prefill")


if __name__ == "__main__":
    sys.exit(main())
