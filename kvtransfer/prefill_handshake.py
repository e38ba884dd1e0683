"""Prefill's side of the handshake with a decode peer: check the fingerprint, choose the backend
by where the peer is, have decode start it, connect, and only then accept the peer.

HELLO (decode: fingerprint, host, offers, transports) ->
  REFUSE              fingerprint mismatch, KV layouts of tensor-parallel ranks that cannot be
                      mapped onto each other (the reason names both), or no backend fits (the
                      reason names both hosts; both layouts when only some backends map them)
  NEED                the chosen backend is not running on decode yet: it starts it and sends
                      HELLO again (without it in the offer if it failed to start)
  connect (transfer thread), then HELLO_OK (backend, reason, prefill's host)
                      for backends that set connections up (CONNECT_AT_BOOTSTRAP); a failed
                      connection is chosen around (auto) or refused (a pinned backend)
  HELLO_OK            at once for the others

The choice and its reason are logged once per peer. Control loop only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pdserve.kvtransfer import control as C
from pdserve.kvtransfer.backends import CONNECT_AT_BOOTSTRAP, LANE_BACKENDS, importable
from pdserve.kvtransfer.backends.shm import ShmEngine
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.control import ControlLoop
from pdserve.kvtransfer.fingerprint import Fingerprint
from pdserve.kvtransfer.hosts import Choice, choose_backend, host_id
from pdserve.kvtransfer.lanes import Lane, LayoutError, identity, plan_lanes
from pdserve.kvtransfer.prefill_transfers import TransferThread

log = logging.getLogger("pdserve.kvtransfer")


class Handshakes:
    def __init__(self, fingerprint: Fingerprint, config: TransferConfig, gpu_pool: bool,
                 xfer: TransferThread, loop: ControlLoop,
                 send: Callable[..., None],
                 accept: Callable[[bytes, str, dict[str, Any], tuple[Lane, ...]], None]
                 ) -> None:
        self.fingerprint = fingerprint
        self.config = config
        self.host = host_id(config.host_id)
        self._gpu_pool = gpu_pool
        self._xfer, self._loop = xfer, loop
        self._send, self._accept_peer = send, accept
        self._since: dict[bytes, float] = {}  # peers between HELLO and HELLO_OK
        self._errors: dict[bytes, dict[str, str]] = {}  # per peer: backend -> connect error
        self._lanes: dict[bytes, tuple[Lane, ...]] = {}  # per peer, from its KV layout

    def pending(self, ident: bytes) -> bool:
        return ident in self._since

    def end(self, ident: bytes) -> None:
        self._since.pop(ident, None)
        self._errors.pop(ident, None)
        self._lanes.pop(ident, None)

    def expire(self, now: float) -> None:
        """Forget handshakes older than the bootstrap timeout (decode's rooms time out)."""
        for ident, t in list(self._since.items()):
            if now - t > self.config.bootstrap_timeout_s:
                self.end(ident)
                self._xfer.drop_peer(ident)

    def on_hello(self, ident: bytes, body: dict[str, Any]) -> None:
        theirs = Fingerprint.from_dict(body["fingerprint"])
        msg = self.fingerprint.mismatch(theirs, "prefill", "decode")
        if msg is not None:
            self._refuse(ident, msg)
            return
        try:
            lanes = plan_lanes(self.fingerprint.kv_layout, theirs.kv_layout)
        except LayoutError as e:
            self._refuse(ident, str(e))
            return
        self._lanes[ident] = lanes
        both = (f"prefill {self.fingerprint.kv_layout.describe()}, decode "
                f"{theirs.kv_layout.describe()}")
        transports = {str(n): i for n, i in body.get("transports", [])}
        offers = [str(n) for n in body.get("offers", list(transports))]
        errors = self._errors.setdefault(ident, {})
        choice = choose_backend(offers, self.config.backend, self.host,
                                str(body.get("host", "")),
                                lambda name: self._unusable(name, transports.get(name), errors,
                                                            lanes, both))
        info = transports.get(choice.backend)
        if not choice.backend:
            self._refuse(ident, choice.reason)
        elif info is None:
            self._since.setdefault(ident, time.monotonic())
            self._send(ident, C.NEED, {"backend": choice.backend, "reason": choice.reason})
        elif choice.backend in CONNECT_AT_BOOTSTRAP:
            self._since.setdefault(ident, time.monotonic())

            def _done(err: str | None) -> None:  # on the transfer thread
                self._loop.call(lambda: self._connected(ident, body, choice, info, err))

            self._xfer.connect(ident, choice.backend, info, _done)
        else:
            self._accept(ident, choice, info)

    def _unusable(self, name: str, info: dict[str, Any] | None, errors: dict[str, str],
                  lanes: tuple[Lane, ...], layouts: str) -> str | None:
        """None when this side can use `name` towards the peer, else why not."""
        if name in errors:
            return f"connecting failed: {errors[name]}"
        if not identity(lanes) and name not in LANE_BACKENDS:
            return (f"moves one pool's whole pages; the KV layouts ({layouts}) need "
                    f"{' or '.join(sorted(LANE_BACKENDS))}")
        if name == "shm":
            return None if info is not None and ShmEngine.usable(info) else (
                "decode's shared-memory pool cannot be mapped from here")
        if name == "cuda_ipc":
            return None if self._gpu_pool else "prefill's pool is not on a GPU"
        return None if importable(name) else "not installed on prefill"

    def _connected(self, ident: bytes, body: dict[str, Any], choice: Choice,
                   info: dict[str, Any], err: str | None) -> None:
        if ident not in self._since:  # the peer left meanwhile
            self._xfer.drop_peer(ident)
        elif err is None:
            self._accept(ident, choice, info)
        else:
            log.warning("kv transfer: connecting to decode %s over %s failed: %s",
                        ident.hex()[:8], choice.backend, err)
            self._errors.setdefault(ident, {})[choice.backend] = err
            self.on_hello(ident, body)  # the next backend, or a refusal naming both hosts

    def _accept(self, ident: bytes, choice: Choice, info: dict[str, Any]) -> None:
        lanes = self._lanes.get(ident, ())
        self.end(ident)
        self._accept_peer(ident, choice.backend, info, lanes)
        log.info("kv transfer with decode %s: %s", ident.hex()[:8], choice.reason)
        self._send(ident, C.HELLO_OK, {"backend": choice.backend, "reason": choice.reason,
                                       "host": self.host})

    def _refuse(self, ident: bytes, reason: str) -> None:
        self.end(ident)
        log.warning("kv transfer: refused decode %s: %s", ident.hex()[:8], reason)
        self._send(ident, C.REFUSE, {"reason": reason})
