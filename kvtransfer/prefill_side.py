"""Prefill half of the KVManager: the bootstrap endpoint, the handshake, per-room senders.

Threads: the control loop owns the ROUTER (bootstrap endpoint) and the peer table; the transfer
thread (prefill_transfers.py) owns the engines' sending state and runs every write in
submission order; scheduler threads call create_sender / send / poll / abort. Ownership: a room
is in `_senders` from create_sender until it ends (Success or Failed); then only a tombstone
remains, so late messages for it are dropped.

Handshake: a decode's HELLO names its host and the backends it offers; prefill chooses one by
where the peer is (hosts.choose_backend), asks decode to start it if it is not running there
(NEED), connects to it on the transfer thread when the backend sets connections up
(CONNECT_AT_BOOTSTRAP), and only then answers HELLO_OK: a peer's first room finds the
connection made. A connection that fails is chosen around (auto) or refused naming both hosts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from pdserve.kvtransfer import control as C
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.engine import ChunkHeader
from pdserve.kvtransfer.fingerprint import Fingerprint
from pdserve.kvtransfer.lanes import Lane
from pdserve.kvtransfer.poll import KVPoll
from pdserve.kvtransfer.prefill_handshake import Handshakes
from pdserve.kvtransfer.prefill_transfers import TransferThread
from pdserve.kvtransfer.rank_pools import PoolSet
from pdserve.kvtransfer.sender import KVSender

log = logging.getLogger("pdserve.kvtransfer")


@dataclass
class _DecodePeer:
    ident: bytes
    backend: str
    info: dict[str, Any]
    last_seen: float
    lanes: tuple[Lane, ...]  # what each of its tensor-parallel ranks receives from ours
    rooms: set[int] = field(default_factory=set)


class PrefillSide:
    def __init__(self, pools: PoolSet, config: TransferConfig,
                 fingerprint: Fingerprint) -> None:
        pool = pools.tensors[0]
        self.pool = pool
        self.num_pool_pages = int(pool.shape[0])
        self.page_bytes = pool[0].numel() * pool.element_size()
        self.config = config
        self.fingerprint = fingerprint
        self.on_change: Callable[[], None] | None = None  # given to every room (RoomState)
        self._lock = threading.Lock()  # guards _senders, _pending, _tombstones
        self._senders: dict[int, KVSender] = {}
        self._pending: dict[int, tuple[bytes, np.ndarray, int, float]] = {}
        self._tombstones: dict[int, float] = {}
        # Rooms a decode peer named as queued in its own queue (last PING): control loop only.
        self._held: dict[int, float] = {}
        self._peers: dict[bytes, _DecodePeer] = {}  # control loop only
        self.loop = C.ControlLoop(self._tick, min(0.05, config.heartbeat_interval_s / 4),
                                  "kv-prefill-control")
        self._router = self.loop.ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        host = config.bootstrap_host
        if config.bootstrap_port:
            self._router.bind(f"tcp://{host}:{config.bootstrap_port}")
            port = config.bootstrap_port
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.bootstrap_addr = f"{host}:{port}"
        self.loop.add_socket(self._router, self._on_message)
        self.xfer = TransferThread(pools, config, self._notify_via_control)
        self.handshakes = Handshakes(fingerprint, config, pool.is_cuda, self.xfer, self.loop,
                                     self._send, self._accept)
        self.loop.start()

    # -- scheduler-facing -----------------------------------------------------------------
    def create_sender(self, room: int) -> KVSender:
        sender = KVSender(room, self)
        with self._lock:
            if room in self._senders:
                raise ValueError(f"room: {room} already has a sender")
            self._senders[room] = sender
            early = room in self._pending  # decode registered before this request came
        if early:  # else the registration finds the sender itself: no wake-up of the loop
            self.loop.call(lambda: self._adopt(sender))
        return sender

    def submit(self, sender: KVSender, header: ChunkHeader) -> None:
        self.xfer.submit(sender, header)

    def fail_room(self, sender: KVSender, reason: str, tell_peer: bool) -> None:
        with sender.write_lock:  # waits for a one-sided write of this room to be issued
            if not sender.state.fail(reason):
                return
            eng = self.xfer.engine(sender.backend)
            if eng is not None:
                eng.quiesce()  # ...and to land: decode may reuse its pages once we confirm
        self._release(sender.room)
        if tell_peer and sender.peer is not None:
            peer = sender.peer
            self.loop.call(lambda: self._send(peer, C.ABORT, {"room": sender.room,
                                                              "reason": reason}))

    def registered_regions(self) -> list[str]:
        return self.xfer.registered_regions()

    def transfer_paths(self) -> dict[str, str]:
        return self.xfer.paths()

    def close(self) -> None:
        with self._lock:
            senders = list(self._senders.values())
        for s in senders:
            s.abort("prefill worker closing")
        self.loop.stop()
        self.xfer.close()

    # -- control loop ---------------------------------------------------------------------
    def _send(self, ident: bytes, kind: bytes, body: dict[str, Any], *blobs: bytes) -> None:
        try:
            self._router.send_multipart([ident, *C.pack(kind, body, *blobs)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone; heartbeats will fail its rooms

    def _notify_via_control(self, ident: bytes, blobs: tuple[bytes, ...]) -> None:
        """A one-sided chunk's NOTIFY, sent by the control loop (the ROUTER's owner)."""
        self.loop.call(lambda: self._send(ident, C.NOTIFY, {}, *blobs))

    def _release(self, room: int) -> None:
        with self._lock:
            sender = self._senders.pop(room, None)
            self._tombstones[room] = time.monotonic()
        if sender is not None and sender.peer is not None:
            peer = sender.peer
            self.loop.call(lambda: self._peers[peer].rooms.discard(room)
                           if peer in self._peers else None)

    def _adopt(self, sender: KVSender) -> None:
        with self._lock:
            reg = self._pending.pop(sender.room, None)
        if reg is not None:
            self._attach(sender, *reg[:3])

    def _attach(self, sender: KVSender, ident: bytes, dst_pages: np.ndarray, slot: int) -> None:
        peer = self._peers.get(ident)
        if peer is None:
            sender.state.fail("decode peer vanished before registration")
            self._release(sender.room)
            return
        sender.peer, sender.dst_pages, sender.aux_slot = ident, dst_pages, slot
        sender.backend, sender.peer_info, sender.lanes = peer.backend, peer.info, peer.lanes
        peer.rooms.add(sender.room)
        sender.state.advance(KVPoll.WaitingForInput)

    def _hold(self, ping: dict[str, Any], now: float) -> None:
        """Rooms decode holds in its own queue (no capacity yet): their bootstrap deadline
        restarts, so a request waiting for decode capacity is not failed here."""
        for room in ping.get("queued", ()):
            self._held[int(room)] = now

    def _on_message(self, frames: list[bytes]) -> None:
        ident, (kind, body, blobs) = frames[0], C.unpack(frames[1:])
        now = time.monotonic()
        peer = self._peers.get(ident)
        if peer is not None:
            peer.last_seen = now
        if kind == C.HELLO:
            self.handshakes.on_hello(ident, body)
        elif peer is None and self.handshakes.pending(ident):
            if kind == C.PING:  # still connecting: alive, no rooms yet
                self._hold(body, now)
                self._send(ident, C.PONG, {"rooms": []})
            elif kind == C.BYE:
                self.handshakes.end(ident)
                self.xfer.drop_peer(ident)
        elif peer is None:
            # A decode that knew a previous incarnation of this worker: make it re-handshake.
            self._send(ident, C.REFUSE, {"reason": "unknown peer (prefill restarted?)"})
        elif kind == C.PING:
            self._hold(body, now)
            # Name the rooms still queued here for this peer: decode's waiting timeout only
            # runs for rooms prefill has forgotten, so a long prefill queue does not fail them.
            with self._lock:
                rooms = [r for r, s in self._senders.items()
                         if s.peer == ident and not s.state.done]
            self._send(ident, C.PONG, {"rooms": rooms})
        elif kind == C.REGISTER:
            room, slot = int(body["room"]), int(body["aux_slot"])
            pages = C.blob_pages(blobs[0] if blobs else b"")
            with self._lock:
                sender = self._senders.get(room)
                dead = room in self._tombstones
                if sender is None and not dead:
                    self._pending[room] = (ident, pages, slot, now)
            if dead:
                self._send(ident, C.ABORT, {"room": room, "reason": "room already finished"})
            elif sender is not None:
                self._attach(sender, ident, pages, slot)
        elif kind == C.ABORT:
            self._on_abort(ident, int(body["room"]), str(body.get("reason", "")),
                           bool(body.get("want_ack")))
        elif kind == C.ACK:
            with self._lock:
                sender = self._senders.get(int(body["room"]))
            if sender is not None and sender.state.advance(KVPoll.Success):
                self._release(sender.room)
        elif kind == C.BYE:
            self._drop_peer(peer, "decode worker closed")

    def _accept(self, ident: bytes, backend: str, info: dict[str, Any],
                lanes: tuple[Lane, ...]) -> None:
        self._peers[ident] = _DecodePeer(ident, backend, info, time.monotonic(), lanes)

    def _on_abort(self, ident: bytes, room: int, reason: str, want_ack: bool) -> None:
        with self._lock:
            sender = self._senders.get(room)
            self._pending.pop(room, None)
            if sender is None:
                self._tombstones[room] = time.monotonic()
        if sender is not None:
            self.fail_room(sender, f"decode aborted: {reason}", tell_peer=False)
        if want_ack:  # one-sided backends: decode may reuse its pages once we confirm
            self._send(ident, C.ABORT, {"room": room, "reason": "abort acknowledged"})

    def _drop_peer(self, peer: _DecodePeer, reason: str) -> None:
        self._peers.pop(peer.ident, None)
        with self._lock:
            senders = [self._senders[r] for r in peer.rooms if r in self._senders]
            for room, reg in list(self._pending.items()):
                if reg[0] == peer.ident:
                    del self._pending[room]
        for s in senders:
            self.fail_room(s, reason, tell_peer=False)
        self.xfer.drop_peer(peer.ident)  # the transfer thread drops the engine connection

    def _tick(self) -> None:
        now, cfg = time.monotonic(), self.config
        for peer in list(self._peers.values()):
            if now - peer.last_seen > cfg.heartbeat_window_s:
                self._drop_peer(peer, f"decode peer silent for {now - peer.last_seen:.1f}s "
                                      f"(heartbeat window {cfg.heartbeat_window_s:.1f}s)")
        self.handshakes.expire(now)
        with self._lock:
            senders = list(self._senders.values())
            for room, reg in list(self._pending.items()):
                if now - reg[3] > cfg.bootstrap_timeout_s:
                    del self._pending[room]
            for room, t in list(self._tombstones.items()):
                if now - t > cfg.finished_room_ttl_s:
                    del self._tombstones[room]
        for room, t in list(self._held.items()):
            if now - t > cfg.bootstrap_timeout_s:
                del self._held[room]
        for s in senders:
            st, since = s.state.status, s.state.since
            if st == KVPoll.Bootstrapping and \
                    now - max(since, self._held.get(s.room, 0.0)) > cfg.bootstrap_timeout_s:
                s.abort(f"bootstrap timeout ({cfg.bootstrap_timeout_s}s): decode never "
                        f"registered")
            # No waiting timeout here: a room waiting for its pages is queued in this worker's
            # own scheduler, which ends it (done, aborted by the router or decode, or its peer
            # died). Decode's waiting timeout covers rooms this side stops listing as queued.
            elif (st == KVPoll.Transferring
                  and now - s.state.progress > cfg.transfer_timeout_s):
                s.abort(f"transfer timeout ({cfg.transfer_timeout_s}s)")
