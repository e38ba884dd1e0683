"""Plain-torch references for the paged attention kernels (one sequence at a time, fp32).

Both read K/V through per-layer strided views `[num_pages, page_size, kv_heads, head_dim]` at
token slots `kv_indices[kv_indptr[i]:kv_indptr[i + 1]]` (slot = page * page_size + offset).
Query head h reads KV head h // (num_heads // kv_heads), as HF's repeat_kv does.
"""

from __future__ import annotations

import torch


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    ps = cache.shape[1]
    pages = torch.div(slots, ps, rounding_mode="floor")
    return cache[pages, slots - pages * ps].float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [n, h, d] at absolute positions q_pos [n]; k/v [L, kvh, d] at positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q [B, H, D], one query per sequence at its last position -> [B, H, D] in q's dtype."""
    out = torch.empty_like(q)
    ptr = kv_indptr.tolist()
    for i in range(q.shape[0]):
        slots = kv_indices[ptr[i]:ptr[i + 1]].to(torch.int64)
        k, v = _gather(k_cache, slots), _gather(v_cache, slots)
        pos = torch.tensor([slots.shape[0] - 1], device=q.device)
        out[i] = _attend(q[i:i + 1], k, v, pos, scale)[0].to(q.dtype)
    return out


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                               kv_indices: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]: sequence i's new tokens are q[qo_indptr[i]:qo_indptr[i+1]], the last ones
    of its KV (whose new K/V are already in the pool); causal over prefix + new tokens."""
    out = torch.empty_like(q)
    qptr, kptr = qo_indptr.tolist(), kv_indptr.tolist()
    for i in range(len(qptr) - 1):
        n = qptr[i + 1] - qptr[i]
        if n == 0:
            continue
        slots = kv_indices[kptr[i]:kptr[i + 1]].to(torch.int64)
        k, v = _gather(k_cache, slots), _gather(v_cache, slots)
        pos = torch.arange(slots.shape[0] - n, slots.shape[0], device=q.device)
        out[qptr[i]:qptr[i + 1]] = _attend(q[qptr[i]:qptr[i + 1]], k, v, pos, scale).to(q.dtype)
    return out
