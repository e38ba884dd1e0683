"""Matrix-vector products for a one-token decode step, with the elementwise work around each
matmul fused into it.

At batch 1 a decoder layer is four weight reads (qkv, o, gate_up, down) and, around them, a
norm, RoPE, the KV store, SiLU-mul and two residual adds: each a launch of its own that moves
a few KB, so together they cost more than their bytes (graph gaps, launch tails). Here each
weight read carries its neighbours:

- `gemv`: y = W x with an optional RMSNorm of x in front (the norm's 1/rms is a scalar, so
  W (x * g / rms) = (W (x * g)) / rms: each program sums x*x while it streams W), an optional
  SiLU-mul of a fused gate/up vector in front (x = silu(gate) * up, computed as it is read),
  and an optional residual added to the result.
- `qkv_rope_store`: the fused qkv projection with the input norm in front and, behind it, the
  bias, RoPE on q and k and the store of k and v into their slot of the page-major pool. One
  program computes matching rows of both halves of a head, so the rotation needs no exchange.

Everything is accumulated and rotated in fp32 with one rounding at the end (the plain-torch
model rounds after the norm, the matmul and the rotation; docs name it the more exact order,
as for kernels/rope.py). Each program streams BLOCK_N whole rows of W; the weight should be
row-major ([N, K], K contiguous): column-major works but reads 2-byte columns (5-7x slower).

On Hopper and later the kernels are launched with programmatic dependent launch (PDL): each
program lets the next kernel in the stream be scheduled as soon as it starts, and waits for the
previous one (`gdc_wait`) before it reads anything, so a kernel's launch and its programs'
start overlap the tail of the one before (`pdl_enabled = False` turns it off).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

pdl_enabled = os.environ.get("PDSERVE_PDL", "1") != "0"


@functools.cache
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether to launch with PDL on `device` (never in the CPU interpreter)."""
    return (pdl_enabled and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and _pdl_capable(device.index if device.index is not None else 0))


@triton.jit
def _pdl_enter(USE_PDL: tl.constexpr):
    """Lets the next kernel be scheduled, then waits until the previous one has finished."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def gemv_reference(x: torch.Tensor, w: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0, silu_mul: bool = False,
                   residual: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K] (or [1, 2K] gate|up with `silu_mul`), w [N, K] -> [1, N], in fp32."""
    h = x.float()
    if silu_mul:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    if norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = h @ w.float().t()
    if residual is not None:
        y = y + residual.float()
    return y.to(out_dtype or x.dtype)


@triton.jit
def _stream_dot(x_ptr, w_ptr, g_ptr, rows, row_mask, K, stride_wn, stride_wk,
                NORM: tl.constexpr, SILU: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(sum_k W[rows, k] * x'[k] in fp32 [BLOCK_N], sum of x'^2 before the norm weight), where
    x' is x, or silu(x[:K]) * x[K:] with SILU, multiplied by the norm weight g with NORM."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + rows[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            if SILU:
                gate = tl.load(x_ptr + cols).to(tl.float32)
                xv = gate * tl.sigmoid(gate) * tl.load(x_ptr + K + cols).to(tl.float32)
            else:
                xv = tl.load(x_ptr + cols).to(tl.float32)
            w = tl.load(w_rows + cols[None, :] * stride_wk, mask=row_mask[:, None], other=0.0)
            if NORM:
                ss += xv * xv
                xv = xv * tl.load(g_ptr + cols).to(tl.float32)
        else:
            col_mask = cols < K
            if SILU:
                gate = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                up = tl.load(x_ptr + K + cols, mask=col_mask, other=0.0).to(tl.float32)
                xv = gate * tl.sigmoid(gate) * up
            else:
                xv = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :] * stride_wk,
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            if NORM:
                ss += xv * xv
                xv = xv * tl.load(g_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xv[None, :]
    return tl.sum(acc, axis=1), tl.sum(ss, axis=0)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, g_ptr, res_ptr, out_ptr, N, K, stride_wn, stride_wk, eps,
    NORM: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    _pdl_enter(USE_PDL)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < N
    y, ss = _stream_dot(x_ptr, w_ptr, g_ptr, rows, row_mask, K, stride_wn, stride_wk,
                        NORM, SILU, EVEN_K, BLOCK_N, BLOCK_K)
    if NORM:
        y = y / tl.sqrt(ss / K + eps)
    if RESIDUAL:
        y += tl.load(res_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def default_blocks(n: int, w: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). Row-major: 256-byte row pieces, 8 warps, and about a
    thousand programs or more (4 rows each up to N = 4096, 8 up to 8192, then 16): the
    fastest of a sweep on an H200 for each Llama-3-8B matrix to within 3%
    (scripts/gpu_kernel_choices.py, docs/performance.md). Column-major: 64-wide column
    pieces (not tuned)."""
    if w.stride(-1) != 1:
        return 64, 32, 4
    return (4 if n <= 4096 else 8 if n <= 8192 else 16), 128, 8


def _check_vector(name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != 2 or t.shape[0] != 1 or t.shape[1] != n or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected [1, {n}] with a contiguous last dim, got "
                         f"{tuple(t.shape)}")


def gemv(x: torch.Tensor, w: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, silu_mul: bool = False, residual: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None,
         blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Triton `gemv_reference`: x [1, K] (or [1, 2K] with `silu_mul`) times w [N, K]^T."""
    if w.dim() != 2:
        raise ValueError(f"w: expected [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    _check_vector("x", x, 2 * k if silu_mul else k)
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight: expected ({k},), got {tuple(norm_weight.shape)}")
    if residual is not None:
        _check_vector("residual", residual, n)
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k, num_warps = blocks or default_blocks(n, w)
    pdl = use_pdl(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, norm_weight if norm_weight is not None else x,
        residual if residual is not None else out, out, n, k, w.stride(0), w.stride(1), eps,
        NORM=norm_weight is not None, SILU=silu_mul, RESIDUAL=residual is not None,
        EVEN_K=k % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl)
    return out


def qkv_rope_store_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot: torch.Tensor, num_heads: int, num_kv_heads: int,
) -> torch.Tensor:
    """q [1, Hq, D] of norm(x) @ w^T (+ bias) after RoPE; k (rotated) and v are written at
    `slot` of the [P, page_size, Hk, D] caches. cos/sin [1, D // 2] fp32."""
    d = k_cache.shape[-1]
    qkv = gemv_reference(x, w, norm_weight=norm_weight, eps=eps, out_dtype=torch.float32)
    if bias is not None:
        qkv = qkv + bias.float()
    q, k, v = qkv.view(num_heads + 2 * num_kv_heads, d).split(
        [num_heads, num_kv_heads, num_kv_heads])
    half = d // 2

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t[:, :half], t[:, half:]
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)

    ps = k_cache.shape[1]
    page, off = int(slot[0]) // ps, int(slot[0]) % ps
    k_cache[page, off] = rotate(k).to(k_cache.dtype)
    v_cache[page, off] = v.to(v_cache.dtype)
    return rotate(q).to(x.dtype)[None]


@triton.jit
def _qkv_rope_store_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr,
    K, stride_wn, stride_wk, eps, stride_cp, stride_co, stride_ch,
    HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    _pdl_enter(USE_PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_D)
    d = (pid % (HALF // BLOCK_D)) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows1 = (head * HEAD_DIM + d).to(tl.int64)
    rows2 = rows1 + HALF
    ok = d < HALF
    y1, ss = _stream_dot(x_ptr, w_ptr, g_ptr, rows1, ok, K, stride_wn, stride_wk,
                         True, False, EVEN_K, BLOCK_D, BLOCK_K)
    y2, _ = _stream_dot(x_ptr, w_ptr, g_ptr, rows2, ok, K, stride_wn, stride_wk,
                        True, False, EVEN_K, BLOCK_D, BLOCK_K)
    rstd = 1.0 / tl.sqrt(ss / K + eps)
    y1 = y1 * rstd
    y2 = y2 * rstd
    if HAS_BIAS:
        y1 += tl.load(b_ptr + rows1).to(tl.float32)
        y2 += tl.load(b_ptr + rows2).to(tl.float32)
    if head < HQ + HK:  # q and k heads are rotated, v heads are not
        c = tl.load(cos_ptr + d)
        s = tl.load(sin_ptr + d)
        r1 = y1 * c - y2 * s
        y2 = y2 * c + y1 * s
        y1 = r1
    if head < HQ:
        dst = q_ptr + head * HEAD_DIM + d
        tl.store(dst, y1.to(q_ptr.dtype.element_ty))
        tl.store(dst + HALF, y2.to(q_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr).to(tl.int64)
        page = slot // PAGE_SIZE
        kv_head = (head - HQ) % HK
        off = page * stride_cp + (slot - page * PAGE_SIZE) * stride_co + kv_head * stride_ch + d
        if head < HQ + HK:
            tl.store(kc_ptr + off, y1.to(kc_ptr.dtype.element_ty))
            tl.store(kc_ptr + off + HALF, y2.to(kc_ptr.dtype.element_ty))
        else:
            tl.store(vc_ptr + off, y1.to(vc_ptr.dtype.element_ty))
            tl.store(vc_ptr + off + HALF, y2.to(vc_ptr.dtype.element_ty))


def default_head_block(half: int, k: int) -> tuple[int, int, int]:
    """(rows per half-head per program, BLOCK_K, num_warps) for `qkv_rope_store`: 4 + 4 rows
    of 1 KB pieces, the fastest of a sweep on an H200 at the Llama-3-8B shape."""
    block_d = 4
    while half % block_d:
        block_d //= 2
    return block_d, 512 if k >= 512 else triton.next_power_of_2(k), 4


def qkv_rope_store(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot: torch.Tensor, num_heads: int, num_kv_heads: int,
    blocks: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Triton `qkv_rope_store_reference`: returns q [1, Hq, D], writes k and v into the pool."""
    d = k_cache.shape[-1]
    rows = (num_heads + 2 * num_kv_heads) * d
    if w.dim() != 2 or w.shape[0] != rows:
        raise ValueError(f"w: expected [{rows}, K] for {num_heads}+2x{num_kv_heads} heads of "
                         f"{d}, got {tuple(w.shape)}")
    k = w.shape[1]
    _check_vector("x", x, k)
    if norm_weight.shape != (k,):
        raise ValueError(f"norm_weight: expected ({k},), got {tuple(norm_weight.shape)}")
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"bias: expected ({rows},), got {tuple(bias.shape)}")
    if d % 2 or k_cache.dim() != 4 or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"k_cache: expected [P, page_size, {num_kv_heads}, even D], got "
                         f"{tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("v_cache: expected k_cache's strides with a contiguous head dim")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (1, d // 2) or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected fp32 [1, {d // 2}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    if slot.numel() != 1:
        raise ValueError(f"slot: expected one slot, got {slot.numel()}")
    q = torch.empty(1, num_heads, d, dtype=x.dtype, device=x.device)
    block_d, block_k, num_warps = blocks or default_head_block(d // 2, k)
    pdl = use_pdl(x.device)
    grid = ((num_heads + 2 * num_kv_heads) * (d // 2 // block_d),)
    _qkv_rope_store_kernel[grid](
        x, w, bias if bias is not None else norm_weight, norm_weight, cos, sin, slot, q,
        k_cache, v_cache, k, w.stride(0), w.stride(1), eps,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HQ=num_heads, HK=num_kv_heads, HEAD_DIM=d, PAGE_SIZE=k_cache.shape[1],
        HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_D=block_d, BLOCK_K=block_k,
        USE_PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
    return q
