"""Decode's receiving engines: what it offers prefill workers, and the engines behind the offer.

A decode worker offers every backend it could receive on (hosts.offers_for), but only starts
the cheap ones with the manager: its same-host path (shm, cuda_ipc) and, for a host pool, tcp.
The cross-host engines (nixl, ucx; tcp for a GPU pool) start the first time a prefill peer
chooses one (the NEED message), on a thread of their own: a NIXL agent or a UCX listener takes
a few hundred milliseconds and costs threads and registered memory a same-host deployment
never uses. An engine that fails to start is withdrawn from the offer, so the next handshake
picks the next backend instead of failing every room.

Threads: the control loop reads `hello()`, `get()` and `offers`; start() runs its engine's
set-up on a short-lived thread and hands the result back under the lock; close() stops them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from pdserve.kvtransfer.backends import make_engine
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.engine import ReceiveHandler, TransferEngine
from pdserve.kvtransfer.rank_pools import PoolSet
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer

log = logging.getLogger("pdserve.kvtransfer")


class ReceivingEngines:
    def __init__(self, offers: list[str], eager: list[str], pools: PoolSet,
                 aux: torch.Tensor, config: TransferConfig, handler: ReceiveHandler,
                 shm: ShmPoolBuffer | None) -> None:
        self._offers = list(offers)
        self._pools, self._pool = pools, pools.tensors[0]
        self._aux, self._config = aux, config
        self._handler, self._shm = handler, shm
        self._lock = threading.Lock()  # guards _engines, _info, _starting, _failed, _closed
        self._engines: dict[str, TransferEngine] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._starting: dict[str, threading.Thread] = {}
        self._failed: dict[str, str] = {}
        self._closed = False
        try:
            for name in eager:
                eng, info = self._make(name)
                self._engines[name], self._info[name] = eng, info
        except Exception:
            self.close()
            raise

    def _make(self, name: str) -> tuple[TransferEngine, dict[str, Any]]:
        cfg = self._config
        eng = make_engine(name, host=cfg.bootstrap_host, shm_pool=self._shm,
                          send_timeout_s=cfg.transfer_timeout_s, ipc_copy=cfg.ipc_copy,
                          stage_bytes=cfg.stage_bytes, lanes=self._pools)
        try:
            eng.register("kv", self._pool)
            eng.register("aux", self._aux)
            return eng, eng.start_receiver(self._handler)
        except Exception:
            eng.close()
            raise

    @property
    def offers(self) -> list[str]:
        """Backends offered now, best first (those that failed to start are withdrawn)."""
        with self._lock:
            return [n for n in self._offers if n not in self._failed]

    def hello(self) -> dict[str, Any]:
        """The HELLO fields: the offer, and how to reach each engine already running."""
        with self._lock:
            return {"offers": [n for n in self._offers if n not in self._failed],
                    "transports": [[n, self._info[n]] for n in self._offers if n in self._info]}

    def get(self, name: str) -> TransferEngine | None:
        with self._lock:
            return self._engines.get(name)

    def start(self, name: str, then: Callable[[str | None], None]) -> None:
        """Start `name` in the background unless it runs or is starting; then(error or None)
        is called from that thread once it is up or has failed (at once if already up)."""
        with self._lock:
            if self._closed or name in self._starting:
                return
            err = self._failed.get(name)
            if name in self._engines or err is not None or name not in self._offers:
                ready = True
            else:
                ready = False
                t = threading.Thread(target=self._start, args=(name, then),
                                     name=f"kv-start-{name}", daemon=True)
                self._starting[name] = t
        if ready:
            then(err if name in self._offers else f"{name} is not offered")
            return
        t.start()

    def _start(self, name: str, then: Callable[[str | None], None]) -> None:
        try:
            eng, info = self._make(name)
            err = None
        except Exception as e:  # noqa: BLE001 - reported, and the backend withdrawn
            eng, info, err = None, {}, f"{type(e).__name__}: {e}"
            log.warning("kv transfer: the %s backend did not start (%s); no longer offered",
                        name, err)
        with self._lock:
            self._starting.pop(name, None)
            closed = self._closed
            if eng is not None and not closed:
                self._engines[name], self._info[name] = eng, info
            elif err is not None:
                self._failed[name] = err
        if eng is not None and closed:
            eng.close()
            return
        then(err)

    def registered(self) -> list[str]:
        with self._lock:
            engines = list(self._engines.values())
        return sorted({r for e in engines for r in e.registered})

    def close(self) -> None:
        with self._lock:
            self._closed = True
            engines, self._engines = list(self._engines.values()), {}
            starting = list(self._starting.values())
        for t in starting:
            t.join(timeout=30)  # it sees _closed and closes its engine itself
        for eng in engines:
            eng.close()
