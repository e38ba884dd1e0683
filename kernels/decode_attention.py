"""Paged decode attention with split-KV (flash-decoding), in Triton: the kernel for batches
below `decode_worklist.uses_worklist` (larger ones take the work list of
kernels/decode_worklist.py, which shares `attend_chunk`).

Stage 1, grid (batch, kv_heads, splits): one program takes all query heads of one KV head's
GQA group (padded to 16 rows so the score matmul runs on tensor cores) against one split of the
sequence's KV, read through the pool's per-layer strided views at token slots, and writes a
partial output with its log-sum-exp. Stage 2, grid (batch, heads): merges the splits.
The grid depends only on the batch size and `num_splits`, never on sequence lengths, and all
lengths are read on the device: a launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import pdl_enter, use_pdl

LOG2E = tl.constexpr(1.4426950408889634)  # exp2 domain: exp(x) = exp2(x * LOG2E)


@triton.jit
def attend_chunk(q_ptr, kc_ptr, vc_ptr, slots_ptr, b, kvh, start, end, sm_scale, stride_qb,
                 stride_qh, stride_cp, stride_co, stride_ch, PAGE_SIZE: tl.constexpr,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EARLY_V: tl.constexpr):
    """Attention of the query heads of KV head `kvh`'s GQA group for sequence `b` (rows past
    GROUP zero, padded to BLOCK_G so the score matmul runs on tensor cores) over the KV at
    token slots slots_ptr[start:end]: the normalised output [BLOCK_G, BLOCK_D] (fp32), its
    log-sum-exp in the exp2 domain (-inf, output 0 for an empty range), the rows' head indices
    and mask, and the head_dim offsets and mask. EARLY_V issues the V load before the first
    matmul."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = sm_scale * LOG2E
    head_off = kvh.to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slot = tl.load(slots_ptr + n, mask=n_mask, other=0).to(tl.int64)
        page = slot // PAGE_SIZE
        kv_off = page * stride_cp + (slot - page * PAGE_SIZE) * stride_co + head_off
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if EARLY_V:
            v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype)) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not EARLY_V:
            v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return out, lse, heads, g_mask, d, d_mask


@triton.jit
def _decode_stage1(
    q_ptr, kc_ptr, vc_ptr, indptr_ptr, indices_ptr, mid_o_ptr, mid_lse_ptr, sm_scale,
    stride_qb, stride_qh, stride_cp, stride_co, stride_ch,
    stride_mb, stride_mh, stride_ms,
    NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr, EARLY_V: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_start = tl.load(indptr_ptr + b).to(tl.int64)
    seq_len = (tl.load(indptr_ptr + b + 1) - seq_start).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    out, lse, heads, g_mask, d, d_mask = attend_chunk(
        q_ptr, kc_ptr, vc_ptr, indices_ptr + seq_start, b, kvh, start, end, sm_scale, stride_qb,
        stride_qh, stride_cp, stride_co, stride_ch, PAGE_SIZE, GROUP, HEAD_DIM, BLOCK_G,
        BLOCK_N, BLOCK_D, EARLY_V)
    mid = b.to(tl.int64) * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(mid_o_ptr + mid[:, None] + d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + mid // BLOCK_D, lse, mask=g_mask)


@triton.jit
def _decode_stage2(
    mid_o_ptr, mid_lse_ptr, o_ptr, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    base = b.to(tl.int64) * stride_mb + h * stride_mh + s * stride_ms
    lse = tl.load(mid_lse_ptr + base // BLOCK_D, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    o = tl.load(mid_o_ptr + base[:, None] + d[None, :],
                mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
             out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def check_decode_args(q: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(page_size, num_kv_heads, GQA group) of a decode call, or a ValueError."""
    num_heads = q.shape[1]
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"q: {num_heads} heads not a multiple of {num_kv_heads} kv heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("k_cache: K/V views must share strides with a contiguous head_dim")
    return page_size, num_kv_heads, num_heads // num_kv_heads


SMALL_BATCH = 8  # up to here: 32 KV tokens per inner step and more splits (split_kv_config)


def split_kv_config(batch_size: int, num_kv_heads: int, num_sms: int) -> tuple[int, int]:
    """(num_splits, block_n) of the split-KV kernel for a decode batch: a function of the batch
    size only, so one CUDA graph per batch size fixes it. A split's length is rounded up to
    `block_n` tokens, so a context shorter than splits x block_n leaves the last splits empty
    (they return at once): the split count caps the parallelism, and longer contexts use it.

    Measured on an H200 (132 SMs, 8 KV heads; docs/performance.md), per layer at batch 1: 1k /
    2k / 4k contexts 8.3 / 9.1 / 12.3 us with 64 splits of 32-token steps against 8.2 / 12.1 /
    20.0 with 16 splits of 64 (the rule before, tuned at 1k only); at batch 8, 32 splits of 32
    tokens 18.2 / 28.4 / 47.5 against 18.4 / 29.9 / 50.5 with 8 of 64. Above batch 8 (the
    Triton backend's split-KV range up to the work list): about one (sequence x KV head x
    split) program per SM, never fewer than 8 splits on a large GPU, 64-token steps.
    """
    floor = min(8, max(1, num_sms // 16))
    if batch_size <= SMALL_BATCH:
        # About 4 programs per SM, and at least SMs / 4 splits (32 at batch 8 on an H200).
        fill = _pow2_floor(max(4 * num_sms // max(1, batch_size * num_kv_heads), num_sms // 4))
        return max(floor, min(64, fill)), 32
    fill = _pow2_floor(num_sms // max(1, batch_size * num_kv_heads))
    return max(floor, min(16, fill)), 64


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 1


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, scale: float,
                     num_splits: int, out: torch.Tensor | None = None,
                     early_v: bool = False, block_n: int = 64) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; k_cache/v_cache [P, page_size, kv_heads, D] strided views.
    `early_v`: each block's V load is issued before its score matmul; `block_n`: KV tokens per
    inner step (A/Bs in bench/gpu_kernel_choices.py)."""
    b, num_heads, head_dim = q.shape
    page_size, num_kv_heads, group = check_decode_args(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    # The lse slot of (b, h, split) is its mid_o offset / block_d: one allocation, no strides.
    mid_o = torch.empty(b, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(b, num_heads, num_splits, dtype=torch.float32, device=q.device)
    sb, sh, ss = mid_o.stride(0), mid_o.stride(1), mid_o.stride(2)
    pdl = use_pdl(q.device)
    _decode_stage1[(b, num_kv_heads, num_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, mid_o, mid_lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        sb, sh, ss,
        NUM_SPLITS=num_splits, PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        USE_PDL=pdl, EARLY_V=early_v, num_warps=4, num_stages=2, launch_pdl=pdl,
    )
    _decode_stage2[(b, num_heads)](
        mid_o, mid_lse, out, sb, sh, ss, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, USE_PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )
    return out
