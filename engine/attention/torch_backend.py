"""Reference attention in plain torch: the CPU serving path and what GPU backends are tested
against.

Per forward pass it plans once: every sequence's KV slots gathered into a padded [B, max_kv]
matrix and a boolean mask that is both causal (query j of sequence i sits at position
prefix_len[i] + j) and padding-aware. Each layer then runs one masked
`scaled_dot_product_attention` over the whole batch; there is no per-sequence Python loop.
GQA is handled by folding each KV head's group of query heads into the query-length axis, so
K/V are never repeated in memory.

With `cpu_kernel=True` (what the engine sets for fp32 on CPU), DECODE batches on CPU take the
C++ paged kernel of `cpu_decode` instead, when its build is ready and every sequence's slots
follow its pages in order (what the paged allocator hands out; checked once per batch). The
torch path above stays the reference the kernel is tested against, and the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.attention import cpu_decode
from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _Plan:
    fb: ForwardBatch  # the batch this plan was built for (identity check)
    kv_slots: torch.Tensor  # [B, max_kv] token slots; padding points at slot 0 and is masked
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool, True = attend
    q_index: torch.Tensor | None  # [B, max_q] rows of q (EXTEND only; DECODE is one per seq)
    q_valid: torch.Tensor | None  # [B, max_q] which padded query rows are real tokens
    max_q: int
    group_mask: torch.Tensor | None = None  # mask repeated over the GQA group, built lazily
    group: int = 0


@dataclass
class _PagedDecodePlan:
    fb: ForwardBatch
    page_table: torch.Tensor  # [B, max_pages] int64; entries past a sequence's end are 0
    seq_lens: torch.Tensor  # [B] int64
    out_slots: torch.Tensor  # [B] int64


def page_table_of(fb: ForwardBatch) -> torch.Tensor | None:
    """[B, max_pages] pages of each sequence if token t of every sequence sits at slot
    page_table[b, t // page_size] * page_size + t % page_size, else None."""
    ps = fb.kv_pool.page_size
    seq_lens = fb.seq_lens.to(torch.int64)
    indptr = fb.kv_indptr.to(torch.int64)
    kv_indices = fb.kv_indices.to(torch.int64)
    max_kv = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else int(seq_lens.max())
    first = torch.arange(0, max_kv, ps)  # position of each page's first token
    valid = first[None, :] < seq_lens[:, None]
    starts = torch.where(valid, indptr[:-1, None] + first[None, :], 0)
    page_table = torch.where(valid, kv_indices[starts] // ps, 0)
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens)
    pos = torch.arange(kv_indices.numel()) - indptr[seq]
    expect = page_table[seq, pos // ps] * ps + pos % ps
    return page_table if torch.equal(expect, kv_indices) else None


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, cpu_kernel: bool = False) -> None:
        self._plan: _Plan | None = None
        self._paged: _PagedDecodePlan | None = None
        self.cpu_kernel = cpu_kernel

    def init_forward(self, fb: ForwardBatch) -> None:
        self._paged = self._paged_decode_plan(fb)
        self._plan = None if self._paged is not None else self._build_plan(fb)

    def _paged_decode_plan(self, fb: ForwardBatch) -> _PagedDecodePlan | None:
        buf = fb.kv_pool.buffer
        if (not self.cpu_kernel or fb.mode != ForwardMode.DECODE or fb.num_tokens == 0
                or buf.device.type != "cpu" or buf.dtype != torch.float32
                or not buf.is_contiguous() or cpu_decode.load(block=False) is None):
            return None
        page_table = page_table_of(fb)
        if page_table is None:
            return None
        return _PagedDecodePlan(fb, page_table, fb.seq_lens.to(torch.int64).contiguous(),
                                fb.out_cache_loc.to(torch.int64).contiguous())

    @staticmethod
    def _build_plan(fb: ForwardBatch) -> _Plan:
        device = fb.seq_lens.device
        seq_lens = fb.seq_lens.to(torch.int64)
        max_kv = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else int(seq_lens.max())
        kpos = torch.arange(max_kv, device=device)
        kv_valid = kpos[None, :] < seq_lens[:, None]  # [B, max_kv]
        src = fb.kv_indptr[:-1, None].to(torch.int64) + kpos[None, :]
        src = torch.where(kv_valid, src, torch.zeros_like(src))
        kv_slots = torch.where(kv_valid, fb.kv_indices[src], torch.zeros_like(src))

        if fb.mode == ForwardMode.DECODE:
            return _Plan(fb, kv_slots, kv_valid[:, None, None, :], None, None, 1)

        extend_lens = fb.extend_lens.to(torch.int64)
        max_q = max(fb.extend_lens_cpu) if fb.extend_lens_cpu else int(extend_lens.max())
        qpos = torch.arange(max_q, device=device)
        q_valid = qpos[None, :] < extend_lens[:, None]  # [B, max_q]
        q_start = torch.cumsum(extend_lens, 0) - extend_lens
        q_index = torch.where(q_valid, q_start[:, None] + qpos[None, :], 0)
        # Absolute position of each padded query row; padding rows still see >= 1 key, so no
        # row is fully masked (which would give NaN) and they are dropped afterwards anyway.
        abs_q = fb.prefix_lens.to(torch.int64)[:, None] + qpos[None, :]  # [B, max_q]
        causal = kpos[None, None, :] <= abs_q[:, :, None]  # [B, max_q, max_kv]
        mask = (causal & kv_valid[:, None, :])[:, None]
        return _Plan(fb, kv_slots, mask, q_index, q_valid, max_q)

    @staticmethod
    def _gather_kv(
        fb: ForwardBatch, layer_id: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pool = fb.kv_pool
        buf = pool.buffer
        if not buf.is_contiguous():
            return pool.get_kv(layer_id, slots)
        # Row view of the page-major pool [pages * layers * 2 * page_size, kvh, d]: one 1-D
        # index_select of rows is a run of small memcpys, where indexing the strided per-layer
        # view with (page, offset) pairs goes through generic advanced indexing, ~100x slower.
        ps = pool.page_size
        rows = pool.k_rows(layer_id, slots)
        flat = buf.view(-1, pool.num_kv_heads, pool.head_dim)
        k = flat.index_select(0, rows.reshape(-1)).view(*slots.shape, *flat.shape[1:])
        v = flat.index_select(0, (rows + ps).reshape(-1)).view(*slots.shape, *flat.shape[1:])
        return k, v

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        fb: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        paged = self._paged
        if (paged is not None and paged.fb is fb and k is not None
                and q.dtype == k.dtype == v.dtype == torch.float32):
            return cpu_decode.paged_decode(
                q.contiguous(), k.contiguous(), v.contiguous(), fb.kv_pool.buffer, layer_id,
                paged.page_table, paged.seq_lens, paged.out_slots, scale)
        if k is not None:
            fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        if fb.num_tokens == 0:
            return q.new_empty(q.shape)
        plan = self._plan
        if plan is None or plan.fb is not fb:
            # Callers that skip init_forward still get a correct plan, built once per batch.
            plan = self._plan = self._build_plan(fb)

        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = fb.kv_pool.num_kv_heads
        group = num_heads // num_kv_heads
        b, max_q = fb.batch_size, plan.max_q

        if plan.group != group:
            # Query heads h = kv_head * group + g share KV head `kv_head` (HF's repeat_kv order).
            m = plan.mask[:, :, None].expand(b, 1, group, max_q, plan.mask.shape[-1])
            plan.group_mask = m.reshape(b, 1, group * max_q, plan.mask.shape[-1])
            plan.group = group

        keys, values = self._gather_kv(fb, layer_id, plan.kv_slots)  # [B, max_kv, kvh, d]
        keys = keys.to(q.dtype).transpose(1, 2)
        values = values.to(q.dtype).transpose(1, 2)

        qp = q[plan.q_index] if plan.q_index is not None else q[:, None]  # [B, max_q, h, d]
        qp = qp.view(b, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        qp = qp.reshape(b, num_kv_heads, group * max_q, head_dim)

        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=plan.group_mask,
                                             scale=scale)
        out = out.view(b, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(b, max_q, num_heads, head_dim)
        if plan.q_valid is None:
            return out.view(b, num_heads, head_dim)
        return out[plan.q_valid]
