"""Where a tensor-parallel worker's ranks keep their KV pools, so that rank 0 (which runs the
worker's KV transfer) maps all of them, and so can a prefill worker on the same host.

Each is a pool share for engine/tp/pools.py: it travels to every rank (pickled; a rank gets a
fresh one), each rank `create`s its own pool with it and publishes the handle, and rank 0
`attach`es the others from their handles. The handles are also what decode offers same-host
peers per rank (lanes.py): a shared-memory segment's name, or a CUDA IPC handle in the
encoding of the cuda_ipc backend.

`PoolSet` is what a KVManager is given: every rank's pool as rank 0 maps it, their handles and
the KV layout.
"""

from __future__ import annotations

import base64
import pickle
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.kvtransfer.lanes import KVLayout
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer, sweep_stale_segments


@dataclass(frozen=True)
class PoolSet:
    """A worker's KV pools, one per tensor-parallel rank (rank 0's first), as rank 0 maps them;
    `handles[r]` maps rank r's from another process of the host."""

    tensors: tuple[torch.Tensor, ...]
    handles: tuple[str, ...]
    layout: KVLayout

    def __post_init__(self) -> None:
        if not len(self.tensors) == len(self.handles) == self.layout.tp:
            raise ValueError(f"tensors: {len(self.tensors)} pools and {len(self.handles)} "
                             f"handles for {self.layout.tp} ranks")
        for (_, heads), t in zip(self.layout.ranks, self.tensors):
            if t.dim() != 6 or t.shape[4] != heads or t.shape[0] != self.tensors[0].shape[0]:
                raise ValueError(f"tensors: pool {tuple(t.shape)} does not hold {heads} KV "
                                 f"heads in {self.tensors[0].shape[0]} pages")


class _Share:
    """Keeps what this process created or mapped, to release it on close(). Not pickled: every
    rank starts with an empty one."""

    def __init__(self) -> None:
        self._held: list[Any] = []

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


class ShmShare(_Share):
    """Host pools in shared-memory segments (the shm backend's); the handle is the name."""

    @property
    def own(self) -> ShmPoolBuffer | None:
        """The first pool this process created (rank 0's own, in rank 0)."""
        owned = [b for b in self._held if b.owner]
        return owned[0] if owned else None

    def create(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, str]:
        if torch.device(device).type != "cpu":
            raise ValueError(f"device: shared-memory pools live in host memory, not {device}")
        sweep_stale_segments()
        buf = ShmPoolBuffer(shape, dtype)
        self._held.append(buf)
        return buf.tensor, buf.name

    def attach(self, handle: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        buf = ShmPoolBuffer(shape, dtype, name=handle, create=False)
        self._held.append(buf)
        return buf.tensor

    def close(self) -> None:
        for buf in reversed(self._held):
            buf.close()
        if any(not b.owner for b in self._held):
            # Rank 0, once the other ranks stopped: the segments of one that was killed (it
            # could not unlink them) go now rather than at the host's next allocation.
            sweep_stale_segments()
        self._held.clear()


def ipc_handle(t: torch.Tensor) -> str:
    """A CUDA tensor's IPC handle, as the cuda_ipc backend encodes it."""
    from torch.multiprocessing.reductions import reduce_tensor

    return base64.b64encode(pickle.dumps(reduce_tensor(t))).decode()


def open_ipc_handle(handle: str) -> torch.Tensor:
    """The tensor behind `ipc_handle`, mapped into this process. Only for handles from the
    processes of this worker or a peer that passed the handshake."""
    rebuild, args = pickle.loads(base64.b64decode(handle))
    return rebuild(*args)


class IpcShare(_Share):
    """GPU pools, each on its rank's GPU, mapped by rank 0 through CUDA IPC."""

    def create(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, str]:
        t = torch.zeros(shape, dtype=dtype, device=device)
        self._held.append(t)
        return t, ipc_handle(t)

    def attach(self, handle: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        t = open_ipc_handle(handle)
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"handle: maps {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
        self._held.append(t)
        return t

    def close(self) -> None:
        self._held.clear()


def pool_share(device: str, tp: int, shm: bool) -> ShmShare | IpcShare | None:
    """How a worker allocates its pools: where rank 0 maps every rank's (tensor parallelism),
    or, `shm`, in shared memory for same-host prefill workers to write (a decode worker's host
    pool); None: plain memory."""
    cuda = device.startswith("cuda")
    if tp > 1:
        return IpcShare() if cuda else ShmShare()
    return ShmShare() if shm and not cuda else None


class RankPoolsLike(Protocol):
    """A worker's rank pools as its engine reports them (engine/tp/pools.RankPools)."""

    tensors: list[torch.Tensor]
    handles: list[str]
    kv_heads: list[tuple[int, int]]


def pool_set(ranks: RankPoolsLike | None, num_kv_heads: int) -> PoolSet | None:
    """The PoolSet of a worker's rank pools; None for one rank (its pool is the manager's
    pool_buffer)."""
    if ranks is None or len(ranks.tensors) <= 1:
        return None
    return PoolSet(tuple(ranks.tensors), tuple(ranks.handles),
                   KVLayout(num_kv_heads, tuple(ranks.kv_heads)))
