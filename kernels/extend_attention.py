"""Paged extend (prefill) attention over a cached prefix, in Triton.

The new tokens' K/V are stored into the pool before this runs, so each sequence's KV is simply
`kv_indices[kv_indptr[i]:kv_indptr[i+1]]` (prefix, then new tokens) and query j of sequence i
sits at absolute position seq_len_i - extend_len_i + j. Grid (batch, heads, query blocks of the
longest extend); blocks past a sequence's extend length store nothing. K/V are read through the
per-layer strided views at token slots, and the causal bound stops each block's key loop at
its last query's position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _extend_kernel(
    q_ptr, o_ptr, kc_ptr, vc_ptr, qo_indptr_ptr, kv_indptr_ptr, indices_ptr, sm_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_co, stride_ch,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(qo_indptr_ptr + b).to(tl.int64)
    ext_len = (tl.load(qo_indptr_ptr + b + 1) - q_start).to(tl.int32)
    kv_start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    seq_len = (tl.load(kv_indptr_ptr + b + 1) - kv_start).to(tl.int32)
    prefix = seq_len - ext_len

    m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < ext_len
    d_mask = d < HEAD_DIM
    q_pos = prefix + m
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    kvh = (h // GROUP).to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys beyond the block's last real query are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, prefix + tl.minimum((mblk + 1) * BLOCK_M, ext_len))
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        slot = tl.load(indices_ptr + kv_start + n, mask=n_mask, other=0).to(tl.int64)
        page = slot // PAGE_SIZE
        kv_off = page * stride_cp + (slot - page * PAGE_SIZE) * stride_co + kvh * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype)) * qk_scale
        ok = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with no visible key yet (only padding rows here) keep m = -inf: avoid inf - inf.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     scale: float, max_extend_len: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; `max_extend_len` (a host int) sizes the grid."""
    t, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"q: {num_heads} heads not a multiple of {num_kv_heads} kv heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("k_cache: K/V views must share strides with a contiguous head_dim")
    out = torch.empty_like(q) if out is None else out
    b = qo_indptr.shape[0] - 1
    if t == 0 or b == 0 or max_extend_len <= 0:
        return out
    block_m = 64 if q.is_cuda else 16
    block_n = 64 if q.is_cuda else 16
    grid = (b, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, out, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        PAGE_SIZE=page_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4, num_stages=2,
    )
    return out
