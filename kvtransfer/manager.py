"""KVManager: one per worker; owns the transfer engines, the rooms, the control thread (bootstrap
endpoint or peer connections, heartbeats, timeouts) and, on prefill, the transfer thread."""

from __future__ import annotations

from typing import Literal

import torch
from typing_extensions import Self

from pdserve.kvtransfer.backends import make_engine
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.decode_side import DecodeSide
from pdserve.kvtransfer.engine import TransferEngine
from pdserve.kvtransfer.fingerprint import Fingerprint
from pdserve.kvtransfer.prefill_side import PrefillSide
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer


def _decode_backends(config: TransferConfig, pool: torch.Tensor, shm: bool) -> list[str]:
    """What decode offers, best first; prefill takes the first it can use."""
    if config.backend == "auto":
        names = ["shm"] if shm else []
        names += ["cuda_ipc"] if pool.is_cuda else ["tcp"]
        return names
    if config.backend == "shm" and not shm:
        raise ValueError("backend: 'shm' needs the decode pool in shared memory "
                         "(pool_buffer=alloc_shm_pool(...))")
    return [config.backend]


class KVManager:
    """The worker-facing transfer API (see the package docstring)."""

    def __init__(self, role: Literal["prefill", "decode"],
                 pool_buffer: torch.Tensor | ShmPoolBuffer, config: TransferConfig,
                 fingerprint: Fingerprint | None = None, model: str = "unknown") -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
        shm = pool_buffer if isinstance(pool_buffer, ShmPoolBuffer) else None
        pool = shm.tensor if shm is not None else pool_buffer
        if pool.dim() != 6 or pool.shape[2] != 2 or not pool.is_contiguous():
            raise ValueError(f"pool_buffer: expected a contiguous page-major tensor, got "
                             f"{tuple(pool.shape)}")
        self.role = role
        self.config = config
        self.fingerprint = fingerprint or Fingerprint.from_pool_buffer(model, pool)
        own = Fingerprint.from_pool_buffer(self.fingerprint.model, pool)
        if (msg := own.mismatch(self.fingerprint, "pool_buffer", "fingerprint")) is not None:
            raise ValueError(msg)
        self._prefill: PrefillSide | None = None
        self._decode: DecodeSide | None = None
        if role == "prefill":
            self._prefill = PrefillSide(pool, config, self.fingerprint)
        else:
            engines: list[TransferEngine] = []
            try:
                for name in _decode_backends(config, pool, shm is not None):
                    engines.append(make_engine(name, host=config.bootstrap_host, shm_pool=shm,
                                               send_timeout_s=config.transfer_timeout_s,
                                               ipc_copy=config.ipc_copy))
                self._decode = DecodeSide(pool, config, self.fingerprint, engines)
            except Exception:
                for e in engines:
                    e.close()
                raise
        self._closed = False

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

    def registered_regions(self) -> list[str]:
        """Memory regions still registered with an engine (empty after close())."""
        side = self._prefill or self._decode
        return side.registered_regions() if side is not None else []

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
