"""A tiled GEMM, y = x W^T, with the elementwise work behind a linear layer fused into its
epilogue: SiLU-mul for the fused gate/up weight (a program computes matching columns of the
gate and the up halves and writes silu(gate) * up) and a residual add.

x is [M, K] and W [N, K], both K-contiguous; tiles are loaded through TMA descriptors on the
GPU (zero-filled past the edges, so M, N and K need not be multiples of the tile). With
SPLIT_K > 1 the K range is split over that many programs per output tile, which add their fp32
partial sums into a zeroed workspace; a second kernel applies the epilogue and rounds. That
fills the GPU at shapes with few output tiles (a decode batch of a few hundred rows against a
4096-wide output). At shapes of many tiles the last wave is split instead: with T tiles on S
SMs (one program each), T mod S tiles would run alone in a last wave that takes as long as a
full one (a 4096-token prefill's gate_up: 27.15 waves of 128 x 128 tiles run in the time of
28 on an H200, docs/performance.md), so those tiles are split over K among the S programs of
that wave, each writing its fp32 partial sum to a workspace that a second kernel adds up.
Accumulation is fp32 with one rounding, as in the plain-torch model's matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.kernels.device import hopper_or_later, num_sms


def gemm_reference(x: torch.Tensor, w: torch.Tensor, *, silu_mul: bool = False,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T in fp32 (-> [M, N / 2] = silu(gate) * up with `silu_mul`), plus
    `residual`, one rounding to x's dtype."""
    y = x.float() @ w.float().t()
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(off_m, off_n) of tile `pid`, walking GROUP_M row tiles per column band (L2 reuse)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group
    pid_n = (pid % per_group) // group
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _epilogue(acc, up, off_m, off_n, M, N, out_ptr, stride_om, res_ptr, stride_rm,
              SILU: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SILU:
        acc = acc * tl.sigmoid(acc) * up
    if RESIDUAL:
        acc += tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :],
                       mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["full_tiles", "tail_splits"])
def _gemm_kernel(
    x_desc, w_desc, out_ptr, res_ptr, part_ptr, M, N, K, stride_om, stride_rm, full_tiles,
    tail_splits, SILU: tl.constexpr, RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """N outputs per row (with SILU the gate rows of W are 0..N-1, the up rows N..2N-1). With
    SPLIT_K > 1, out is a zeroed fp32 [M, N] (x2 with SILU: gate then up) workspace. Programs
    from `full_tiles` on each take 1 / `tail_splits` of the K range of one of the remaining
    tiles and write its partial sums to `part_ptr` (for _tail_kernel). Split counts are
    runtime values: one compiled kernel whatever the shape."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile = pid
    k_first = tl.program_id(1) * tl.cdiv(k_tiles, SPLIT_K)
    k_last = min(k_first + tl.cdiv(k_tiles, SPLIT_K), k_tiles)
    if pid >= full_tiles:
        part = pid - full_tiles
        tile = full_tiles + part // tail_splits
        k_first = (part % tail_splits) * tl.cdiv(k_tiles, tail_splits)
        k_last = min(k_first + tl.cdiv(k_tiles, tail_splits), k_tiles)
    off_m, off_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(k_first, k_last):
        a = x_desc.load([off_m, kt * BLOCK_K])
        b = w_desc.load([off_n, kt * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
        if SILU:
            b2 = w_desc.load([N + off_n, kt * BLOCK_K])
            up = tl.dot(a, b2.T, up)
    if SPLIT_K > 1:
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        if SILU:
            tl.atomic_add(ptrs + N, up, mask=mask, sem="relaxed")
    elif pid < full_tiles:
        _epilogue(acc, up, off_m, off_n, M, N, out_ptr, stride_om, res_ptr, stride_rm,
                  SILU, RESIDUAL, BLOCK_M, BLOCK_N)
    else:
        # Partial p of a tail tile: [(2 if SILU) x BLOCK_M x BLOCK_N] fp32 at block p.
        size = (2 if SILU else 1) * BLOCK_M * BLOCK_N
        tile_ptrs = (tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
        base = part_ptr + (pid - full_tiles).to(tl.int64) * size
        tl.store(base + tile_ptrs, acc)
        if SILU:
            tl.store(base + BLOCK_M * BLOCK_N + tile_ptrs, up)


@triton.jit
def _finish_kernel(ws_ptr, out_ptr, res_ptr, M, N, stride_wm, stride_om, stride_rm,
                   SILU: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The epilogue over a split-K workspace."""
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    ptrs = ws_ptr + rows[:, None].to(tl.int64) * stride_wm + cols[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    up = tl.load(ptrs + N, mask=mask, other=0.0) if SILU else acc
    _epilogue(acc, up, off_m, off_n, M, N, out_ptr, stride_om, res_ptr, stride_rm,
              SILU, RESIDUAL, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["full_tiles", "tail_splits"])
def _tail_kernel(part_ptr, out_ptr, res_ptr, M, N, stride_om, stride_rm, full_tiles,
                 tail_splits, SILU: tl.constexpr, RESIDUAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                 SUB_M: tl.constexpr):
    """Rows [SUB_M * program_id(1), +SUB_M) of tail tile program_id(0): its `tail_splits`
    partial sums added in order, then the epilogue."""
    slot = tl.program_id(0)
    sub = tl.program_id(1) * SUB_M
    off_m, off_n = _tile(full_tiles + slot, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    size = (2 if SILU else 1) * BLOCK_M * BLOCK_N
    ptrs = (part_ptr + slot.to(tl.int64) * tail_splits * size
            + (sub + tl.arange(0, SUB_M))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    acc = tl.zeros([SUB_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([SUB_M, BLOCK_N], dtype=tl.float32)
    for p in range(tail_splits):
        acc += tl.load(ptrs + p * size)
        if SILU:
            up += tl.load(ptrs + p * size + BLOCK_M * BLOCK_N)
    _epilogue(acc, up, off_m + sub, off_n, M, N, out_ptr, stride_om, res_ptr, stride_rm,
              SILU, RESIDUAL, SUB_M, BLOCK_N)


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, num_warps, num_stages)
Config = tuple[int, int, int, int, int, int, int]
DEFAULT_CONFIG: Config = (128, 128, 64, 8, 1, 8, 4)
# Fewest rows for which the model's MLP runs gate_up + SiLU-mul through `gemm` (below that,
# cuBLAS and kernels/silu_mul.py).
SILU_MIN_ROWS = 64
# Fewest K tiles a program of a split last wave accumulates.
TAIL_MIN_K_TILES = 4


def supported(device: torch.device) -> bool:
    """Whether the engine uses this GEMM on `device`: CUDA with TMA (Hopper and later), the only
    GPUs it was measured on."""
    return hopper_or_later(device)


def silu_config(m: int) -> Config:
    """The fastest of a sweep on an H200 for the Llama-3-8B gate_up weight with SiLU-mul
    (bench/gpu_gemm_choices.py, docs/performance.md): 64 x 64 tiles (of each half) up to 64
    rows, 128 x 128 above."""
    return (64, 64, 64, 8, 1, 4, 4) if m <= 64 else DEFAULT_CONFIG


def tail_splits(tiles: int, sms: int, k_tiles: int) -> int:
    """Over how many programs each tile of a last, partial wave is split along K (1: none):
    as many as the wave has room for, each left with at least TAIL_MIN_K_TILES K tiles."""
    rest = tiles % sms if sms > 0 else 0
    if tiles < sms or rest == 0:
        return 1
    return max(1, min(sms // rest, k_tiles // TAIL_MIN_K_TILES))


def gemm(x: torch.Tensor, w: torch.Tensor, *, silu_mul: bool = False,
         residual: torch.Tensor | None = None, config: Config | None = None,
         out: torch.Tensor | None = None, sms: int | None = None) -> torch.Tensor:
    """Triton `gemm_reference`: x [M, K] times w [N, K]^T (-> [M, N / 2] with `silu_mul`),
    plus `residual` [M, N(/2)]. `sms`: programs that run at once, for the last-wave split
    (None: the GPU's SM count; 0: no split)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not chain")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("gemm: x and w must be K-contiguous")
    if silu_mul and w.shape[0] % 2:
        raise ValueError(f"gemm: silu_mul needs an even number of rows, got {w.shape[0]}")
    m, k = x.shape
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    if residual is not None and (residual.shape != (m, n) or residual.stride(-1) != 1):
        raise ValueError(f"gemm: residual must be [{m}, {n}] with a contiguous last dim, got "
                         f"{tuple(residual.shape)}")
    if config is None:
        config = silu_config(m) if silu_mul else DEFAULT_CONFIG
    bm, bn, bk, group_m, split_k, warps, stages = config
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    res = residual if residual is not None else out
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    flags = {"SILU": silu_mul, "RESIDUAL": residual is not None, "BLOCK_M": bm, "BLOCK_N": bn}
    launch = {"BLOCK_K": bk, "GROUP_M": group_m, "num_warps": warps, "num_stages": stages}
    if split_k > 1:
        ws = torch.zeros(m, 2 * n if silu_mul else n, device=x.device, dtype=torch.float32)
        _gemm_kernel[(tiles, split_k)](x_desc, w_desc, ws, res, ws, m, n, k, ws.stride(0),
                                       res.stride(0), tiles, 1, SPLIT_K=split_k, **flags,
                                       **launch)
        flags.update(BLOCK_M=32, BLOCK_N=128)
        _finish_kernel[(triton.cdiv(m, 32), triton.cdiv(n, 128))](
            ws, out, res, m, n, ws.stride(0), out.stride(0), res.stride(0), num_warps=4,
            **flags)
        return out
    if sms is None:
        sms = num_sms(x.device) if x.is_cuda else 0
    splits = tail_splits(tiles, sms, triton.cdiv(k, bk))
    rest = tiles % sms if splits > 1 else 0
    part = (torch.empty(rest * splits * (2 if silu_mul else 1) * bm * bn, device=x.device,
                        dtype=torch.float32) if rest else out)
    _gemm_kernel[(tiles - rest + rest * splits, 1)](
        x_desc, w_desc, out, res, part, m, n, k, out.stride(0), res.stride(0), tiles - rest,
        splits, SPLIT_K=1, **flags, **launch)
    if rest:
        sub = min(bm, 32)
        _tail_kernel[(rest, bm // sub)](part, out, res, m, n, out.stride(0), res.stride(0),
                                        tiles - rest, splits, GROUP_M=group_m, SUB_M=sub,
                                        num_warps=4, **flags)
    return out
