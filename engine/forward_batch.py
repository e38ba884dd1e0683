"""What one forward pass needs: token inputs, positions, KV slots, and per-sequence lengths.

Slots are token-level KV indices: slot = page * page_size + offset_in_page.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.kernels.device import to_device

if TYPE_CHECKING:
    from pdserve.engine.attention.base import AttentionBackend
    from pdserve.engine.kv_pool import KVPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of new tokens on top of a (possibly empty) cached prefix
    DECODE = 2  # exactly one new token per sequence
    IDLE = 3  # nothing to run


@dataclass
class ForwardBatch:
    """Inputs of one forward pass over B sequences and T = sum(extend_lens) new tokens.

    - `input_ids`, `positions`, `out_cache_loc`: [T], the new tokens, their absolute positions
      and the KV slots they are written to (in sequence order).
    - `seq_lens`: [B] total length of each sequence after this pass (prefix + new).
    - `prefix_lens`: [B] tokens already in the KV cache before this pass.
    - `extend_lens`: [B] new tokens per sequence (all ones in DECODE).
    - `kv_indptr` [B+1] / `kv_indices` [sum(seq_lens)]: every KV slot of every sequence,
      in position order, including this pass's new tokens.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_pool: KVPool
    attn_backend: AttentionBackend
    # Host copies of the per-sequence lengths: backends plan with them without a device sync.
    seq_lens_cpu: list[int] | None = None
    extend_lens_cpu: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class HostBatch:
    """A ForwardBatch's inputs on the host, before upload: every index tensor packed into one
    int64 tensor (one upload; and what tensor-parallel ranks receive from rank 0 each step).

    `data` is input_ids, positions, out_cache_loc [T each]; seq_lens, prefix_lens, extend_lens
    [B each]; kv_indptr [B+1]; kv_indices [K]."""

    mode: ForwardMode
    batch_size: int
    num_tokens: int
    data: torch.Tensor

    def sizes(self) -> list[int]:
        t, b = self.num_tokens, self.batch_size
        return [t, t, t, b, b, b, b + 1, self.data.numel() - 3 * t - 4 * b - 1]

    def to_forward_batch(self, kv_pool: KVPool, attn_backend: AttentionBackend,
                         device: torch.device) -> ForwardBatch:
        sizes = self.sizes()
        host = self.data.split(sizes)
        (input_ids, positions, out_loc, seq_lens, prefix, ext, indptr,
         kv_indices) = to_device(self.data, device).split(sizes)
        return ForwardBatch(
            mode=self.mode, input_ids=input_ids, positions=positions, out_cache_loc=out_loc,
            seq_lens=seq_lens, prefix_lens=prefix, extend_lens=ext, kv_indptr=indptr,
            kv_indices=kv_indices, kv_pool=kv_pool, attn_backend=attn_backend,
            seq_lens_cpu=host[3].tolist(), extend_lens_cpu=host[5].tolist())
