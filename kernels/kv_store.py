"""KV store: write one layer's new K/V rows into their token slots of the page-major pool.

The destination is a per-layer strided view `[num_pages, page_size, kv_heads, head_dim]` of the
pool (see engine/kv_pool.py); slot = page * page_size + offset. The reference is
`KVPool.set_kv`; `store_kv_reference` below is the same computation on bare views.
One program copies BLOCK_T tokens' K and V rows (kv_heads * head_dim elements each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache/v_cache [P, page_size, H, D] views; slots [T]; k/v [T, H, D]."""
    ps = k_cache.shape[1]
    pages = torch.div(slots, ps, rounding_mode="floor")
    offs = slots - pages * ps
    k_cache[pages, offs] = k.to(k_cache.dtype)
    v_cache[pages, offs] = v.to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_co, stride_ch,
    PAGE_SIZE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot - page * PAGE_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HEADS) & (d < HEAD_DIM)
    t64 = t.to(tl.int64)
    kv = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=mask)
    vv = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=mask)
    dst = page * stride_cp + off * stride_co + h * stride_ch + d
    tl.store(kc_ptr + dst, kv.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, vv.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Triton version of `store_kv_reference`; k/v may be strided views of a fused qkv."""
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("v_cache: strides must equal k_cache's (two views of one pool)")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("k: head_dim must be the contiguous (last) dimension")
    _, page_size, heads, head_dim = k_cache.shape
    if tuple(k.shape) != (num_tokens, heads, head_dim) or k.shape != v.shape:
        raise ValueError(f"k: expected {(num_tokens, heads, head_dim)}, got {tuple(k.shape)}")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        PAGE_SIZE=page_size, HEADS=heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
