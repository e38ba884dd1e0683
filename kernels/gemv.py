"""Matrix-vector products for a one-token decode step, with the elementwise work around each
matmul fused into it.

At batch 1 a decoder layer is four weight reads (qkv, o, gate_up, down) and, around them, a
norm, RoPE, the KV store, SiLU-mul and two residual adds: each a launch of its own that moves
a few KB, so together they cost more than their bytes (graph gaps, launch tails). Here each
weight read carries its neighbours:

- `gemv`: y = W x with an optional RMSNorm of x in front (the norm's 1/rms is a scalar, so
  W (x * g / rms) = (W (x * g)) / rms: each program sums x*x while it streams W), an optional
  residual added to the result, and an optional SiLU-mul behind it for the fused gate/up
  weight: a program computes matching rows of the gate and the up halves and writes
  silu(gate) * up, so the activation never round-trips through memory at twice its size.
- `qkv_rope_store`: the fused qkv projection with the input norm in front and, behind it, the
  bias, RoPE on q and k and the store of k and v into their slot of the page-major pool. One
  program computes matching rows of both halves of a head, so the rotation needs no exchange.

Everything is accumulated and rotated in fp32 with one rounding at the end (the plain-torch
model rounds after the norm, the matmul and the rotation: this is the more exact order, as in
kernels/rope.py). Each program streams BLOCK_N whole rows of W; the weight should be row-major
([N, K], K contiguous): column-major works but reads 2-byte columns (on an H200 4.6-7.1x
slower than cuBLAS for qkv, o_proj and down).

On Hopper and later the kernels are launched with programmatic dependent launch
(kernels/pdl.py): a kernel's launch and its programs' start overlap the tail of the one before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels.pdl import pdl_enter, use_pdl


def gemv_reference(x: torch.Tensor, w: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0, silu_mul: bool = False,
                   residual: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K], w [N, K] -> [1, N] (or [1, N / 2] = silu(gate) * up with `silu_mul`), fp32
    throughout, one rounding to `out_dtype` (default x's)."""
    h = x.float()
    if norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = h @ w.float().t()
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(out_dtype or x.dtype)


@triton.jit
def _stream_dot(x_ptr, w_ptr, g_ptr, rows, rows2, row_mask, K, stride_wn, stride_wk,
                NORM: tl.constexpr, PAIR: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k W[rows, k] * x[k] * g[k] in fp32 [BLOCK_N], the same over `rows2` with PAIR
    (streamed in the same loop: twice the loads in flight), and sum_k x[k]^2. g = 1 without
    NORM."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + rows[:, None] * stride_wn
    w_rows2 = w_ptr + rows2[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xv = tl.load(x_ptr + cols).to(tl.float32)
            mask = row_mask[:, None]
            gv = tl.load(g_ptr + cols).to(tl.float32) if NORM else xv
        else:
            col_mask = cols < K
            xv = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            mask = row_mask[:, None] & col_mask[None, :]
            gv = tl.load(g_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) if NORM else xv
        w = tl.load(w_rows + cols[None, :] * stride_wk, mask=mask, other=0.0)
        if PAIR:
            w2 = tl.load(w_rows2 + cols[None, :] * stride_wk, mask=mask, other=0.0)
        if NORM:
            ss += xv * xv
            xv = xv * gv
        acc += w.to(tl.float32) * xv[None, :]
        if PAIR:
            acc2 += w2.to(tl.float32) * xv[None, :]
    return tl.sum(acc, axis=1), tl.sum(acc2, axis=1), tl.sum(ss, axis=0)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, g_ptr, res_ptr, out_ptr, N, K, stride_wn, stride_wk, eps,
    NORM: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """N is the number of outputs: the rows of W, or with SILU half of them (gate, then up)."""
    pdl_enter(USE_PDL)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < N
    y, up, ss = _stream_dot(x_ptr, w_ptr, g_ptr, rows, rows + N, row_mask, K, stride_wn,
                            stride_wk, NORM, SILU, EVEN_K, BLOCK_N, BLOCK_K)
    if NORM:
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        y = y * rstd
        up = up * rstd
    if SILU:
        y = y * tl.sigmoid(y) * up
    if RESIDUAL:
        y += tl.load(res_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def default_blocks(n: int, w: torch.Tensor, norm: bool = False, silu_mul: bool = False
                   ) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), the fastest of a sweep on an H200 for each Llama-3-8B
    matrix as the decode path runs it, to within a few % (bench/gpu_kernel_choices.py,
    docs/performance.md). Row-major: with the norm in front or over 8192 rows, 16 rows (8 gate
    and 8 up rows with SiLU-mul) of 512-byte pieces per program under 4 warps; otherwise 4
    rows (8 over 4096) of 256-byte pieces under 8 warps. Column-major: 64-wide column pieces
    (not tuned)."""
    if w.stride(-1) != 1:
        return 64, 32, 4
    if norm or silu_mul or n > 8192:
        return (8 if silu_mul else 16), 256, 4
    return (4 if n <= 4096 else 8), 128, 8


def _check_vector(name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != 2 or t.shape[0] != 1 or t.shape[1] != n or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected [1, {n}] with a contiguous last dim, got "
                         f"{tuple(t.shape)}")


def gemv(x: torch.Tensor, w: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, silu_mul: bool = False, residual: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, blocks: tuple[int, int, int] | None = None,
         pdl: bool | None = None) -> torch.Tensor:
    """Triton `gemv_reference`: x [1, K] times w [N, K]^T (-> [1, N / 2] with `silu_mul`).
    `pdl`: launch with programmatic dependent launch (default: `use_pdl`)."""
    if w.dim() != 2 or (silu_mul and w.shape[0] % 2):
        raise ValueError(f"w: expected [N, K] (N even with silu_mul), got {tuple(w.shape)}")
    k = w.shape[1]
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    _check_vector("x", x, k)
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight: expected ({k},), got {tuple(norm_weight.shape)}")
    if residual is not None:
        _check_vector("residual", residual, n)
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k, num_warps = blocks or default_blocks(n, w, norm_weight is not None,
                                                           silu_mul)
    pdl = use_pdl(x.device) if pdl is None else pdl
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
    pdl_enter(USE_PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_D)
    d = (pid % (HALF // BLOCK_D)) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows1 = (head * HEAD_DIM + d).to(tl.int64)
    rows2 = rows1 + HALF
    ok = d < HALF
    y1, y2, ss = _stream_dot(x_ptr, w_ptr, g_ptr, rows1, rows2, ok, K, stride_wn, stride_wk,
                             True, True, EVEN_K, BLOCK_D, BLOCK_K)
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
    of 1 KB pieces under 4 warps, the fastest of a sweep on an H200 at the Llama-3-8B shape."""
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
