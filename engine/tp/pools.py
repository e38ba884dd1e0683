"""Every rank's KV pool, mapped in rank 0 (for KV transfer between workers).

KV transfer runs in rank 0, which owns the bootstrap endpoint and every room, and it moves the
KV heads of every rank: so rank 0 maps every rank's pool. A role that transfers KV builds its
engine with a `PoolShare`. It travels to the other ranks (it must pickle): each rank allocates
its pool with it and publishes a handle in the group's store, and rank 0 maps the other pools
from their handles. Host pools are shared-memory segments and GPU pools are exported as CUDA
IPC handles (kvtransfer/rank_pools.py has both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch


class PoolShare(Protocol):
    def create(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, str]:
        """This rank's pool buffer, and the handle another process of the worker maps it by."""
        ...

    def attach(self, handle: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """Rank 0: another rank's pool, mapped from its handle."""
        ...

    def close(self) -> None:
        """Releases what this process created or mapped (rank 0: once the worker stopped)."""
        ...


@dataclass
class RankPools:
    """What rank 0 sees of every rank's pool: `tensors[r]` (rank 0's own first), `handles[r]`,
    and each rank's KV heads `(first, count)` of the model's."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    handles: list[str] = field(default_factory=list)
    kv_heads: list[tuple[int, int]] = field(default_factory=list)
    close: Callable[[], None] = lambda: None
