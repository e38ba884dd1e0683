"""The interface every attention backend (torch reference, Triton, FlashInfer) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.engine.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Stores a layer's new K/V into the pool and attends over each sequence's KV.

    `init_forward(fb)` is called once per forward pass (plan); `forward` once per layer (run).
    A caller that has written the new K/V into the pool itself (kernels/gemv.py fuses the store
    into the qkv projection) passes k = v = None; the EXTEND paths that read the new K/V from
    their projection (FlashInfer's ragged prefill) need them.
    """

    def init_forward(self, fb: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Per-batch planning (index building); the default needs none."""

    @abstractmethod
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None: already in the pool
        v: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None: already in the pool
        fb: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
