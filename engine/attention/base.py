"""The interface every attention backend (torch reference, Triton, FlashInfer) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.engine.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Stores a layer's new K/V into the pool and attends over each sequence's KV.

    `init_forward(fb)` is called once per forward pass (plan); `forward` once per layer (run).
    """

    def init_forward(self, fb: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Per-batch planning (index building); the default needs none."""

    @abstractmethod
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        fb: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
