"""What one forward pass needs: token inputs, positions, KV slots, and per-sequence lengths.

Slots are token-level KV indices: slot = page * page_size + offset_in_page.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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
