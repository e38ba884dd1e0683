"""KVManager: one per worker; owns the transfer engines, the rooms, the control thread (bootstrap
endpoint or peer connections, heartbeats, timeouts) and, on prefill, the transfer thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from typing_extensions import Self

from pdserve.kvtransfer.backends import available_backends, importable
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.decode_side import DecodeSide
from pdserve.kvtransfer.fingerprint import Fingerprint
from pdserve.kvtransfer.hosts import SAME_HOST_BACKENDS, offers_for
from pdserve.kvtransfer.prefill_side import PrefillSide
from pdserve.kvtransfer.rank_pools import IpcShare, PoolSet, RankPoolsLike, ShmShare, pool_set
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer


def _check_installed(config: TransferConfig, pool: torch.Tensor) -> None:
    """A pinned backend this process cannot run is a configuration error, found at start-up."""
    name = config.backend
    if name == "cuda_ipc" and not pool.is_cuda:
        raise ValueError("backend: 'cuda_ipc' needs the pool on a GPU")
    if name in ("ucx", "nixl") and not importable(name):
        extra = {"ucx": "ucxx (pip install 'pdserve[ucx]')",
                 "nixl": "NIXL (pip install 'pdserve[nixl]')"}[name]
        raise ValueError(f"backend: {name!r} needs {extra}, which is not installed")


def _decode_engines(config: TransferConfig, pool: torch.Tensor,
                    shm: bool) -> tuple[list[str], list[str]]:
    """(what decode offers, best first; the engines it starts at once). Prefill picks from the
    offer by host (hosts.py); the cross-host engines start when first chosen."""
    if config.backend == "shm" and not shm:
        raise ValueError("backend: 'shm' needs the decode pool in shared memory "
                         "(pool_buffer=alloc_shm_pool(...))")
    offers = offers_for(config.backend, shm, pool.is_cuda, importable)
    if config.backend != "auto":
        return offers, offers
    eager = [n for n in offers if n in SAME_HOST_BACKENDS or (n == "tcp" and not pool.is_cuda)]
    return offers, eager


class KVManager:
    """The worker-facing transfer API (see the package docstring)."""

    def __init__(self, role: Literal["prefill", "decode"],
                 pool_buffer: torch.Tensor | ShmPoolBuffer, config: TransferConfig,
                 fingerprint: Fingerprint | None = None, model: str = "unknown",
                 pools: PoolSet | None = None) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
        shm = pool_buffer if isinstance(pool_buffer, ShmPoolBuffer) else None
        pool = shm.tensor if shm is not None else pool_buffer
        if pool.dim() != 6 or pool.shape[2] != 2 or not pool.is_contiguous():
            raise ValueError(f"pool_buffer: expected a contiguous page-major tensor, got "
                             f"{tuple(pool.shape)}")
        if pools is not None and pools.tensors[0].data_ptr() != pool.data_ptr():
            raise ValueError("pools: rank 0's pool must be pool_buffer")
        self.role = role
        self.config = config
        layout = pools.layout if pools is not None else None
        self.fingerprint = fingerprint or Fingerprint.from_pool_buffer(model, pool, layout)
        own = Fingerprint.from_pool_buffer(self.fingerprint.model, pool, layout)
        if (msg := own.mismatch(self.fingerprint, "pool_buffer", "fingerprint")) is not None:
            raise ValueError(msg)
        if own.kv_ranks != self.fingerprint.kv_ranks:
            raise ValueError(f"fingerprint: KV layout {self.fingerprint.kv_layout.describe()}, "
                             f"the pools {own.kv_layout.describe()}")
        _check_installed(config, pool)
        # Every rank's pool (one, without tensor parallelism): the lanes of a transfer.
        lanes = pools or PoolSet((pool,), (shm.name if shm is not None else "",),
                                 own.kv_layout)
        self._prefill: PrefillSide | None = None
        self._decode: DecodeSide | None = None
        if role == "prefill":
            self._prefill = PrefillSide(lanes, config, self.fingerprint)
        else:
            offers, eager = _decode_engines(config, pool, shm is not None)
            self._decode = DecodeSide(lanes, config, self.fingerprint, offers, eager, shm)
        self._closed = False

    @classmethod
    def for_worker(cls, role: Literal["prefill", "decode"], pool: torch.Tensor, model: str,
                   num_kv_heads: int, ranks: RankPoolsLike | None,
                   share: ShmShare | IpcShare | None, config: TransferConfig) -> KVManager:
        """A worker's manager over its pools: `pool` (rank 0's; in the shared-memory segment
        `share` made, if it did) and, with tensor parallelism, every rank's pool as rank 0
        maps them (`ranks`)."""
        pools = pool_set(ranks, num_kv_heads)
        own = share.own if isinstance(share, ShmShare) else None
        fingerprint = Fingerprint.from_pool_buffer(model, pool, pools.layout if pools else None)
        return cls(role, own or pool, config, fingerprint, pools=pools)

    @property
    def offered_backends(self) -> list[str]:
        """Decode: the backends it offers prefill workers, best first. Prefill: the backends it
        can send with (a pinned one, or every one this process can run)."""
        if self._decode is not None:
            return self._decode.engines.offers
        if self.config.backend != "auto":
            return [self.config.backend]
        pool = self._prefill.pool if self._prefill is not None else None
        gpu = pool is not None and pool.is_cuda
        return [n for n in available_backends() if n != "cuda_ipc" or gpu]

    @property
    def bootstrap_addr(self) -> str:
        """Prefill: "host:port" of the bootstrap endpoint decode workers connect to."""
        if self._prefill is None:
            raise ValueError("role: only a prefill manager has a bootstrap address")
        return self._prefill.bootstrap_addr

    def create_sender(self, room: int) -> KVSender:
        if self._prefill is None:
            raise ValueError("role: create_sender needs role='prefill'")
        return self._prefill.create_sender(room)

    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        if self._decode is None:
            raise ValueError("role: create_receiver needs role='decode'")
        return self._decode.create_receiver(room, bootstrap_addr)

    def wake_on_change(self, wake: Callable[[], None]) -> None:
        """Call `wake()` whenever a room created from now on changes status (on the thread that
        changed it): the scheduler polling the rooms runs at once, not at its next idle poll."""
        (self._prefill or self._decode).on_change = wake

    def registered_regions(self) -> list[str]:
        """Memory regions still registered with an engine (empty after close())."""
        side = self._prefill or self._decode
        return side.registered_regions() if side is not None else []

    def transfer_paths(self) -> dict[str, str]:
        """Prefill: how pages move to each decode peer where the backend has several ways
        (ucx: `ucx/mapped`, `ucx/puts` or `ucx/staged`); empty elsewhere."""
        return self._prefill.transfer_paths() if self._prefill is not None else {}

    def close(self) -> None:
        """Fail every live room (peers are told), stop threads, close sockets, deregister
        every region. The pool buffer itself (and its shm segment) stays the caller's."""
        if self._closed:
            return
        self._closed = True
        if self._prefill is not None:
            self._prefill.close()
        if self._decode is not None:
            self._decode.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
