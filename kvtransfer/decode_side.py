"""Decode half of the KVManager: one DEALER per prefill worker, per-room receivers, the
receiving engines (decode_engines.py).

Handshake: HELLO (fingerprint, host, the backends offered, how to reach the running ones) ->
prefill chooses (hosts.py) and answers HELLO_OK, REFUSE, or NEED when the chosen engine is not
running here yet: it is started and the HELLO sent again.

Threads: the control loop owns every DEALER and the peer table; engine threads (tcp, ucx) place
chunks through place_chunk(); scheduler threads call create_receiver / init / poll / abort.
Ownership: destination pages belong to the decode scheduler. With a one-sided backend (shm,
cuda_ipc, nixl) prefill writes them directly, so a room that decode fails is reported Failed only
after prefill confirmed the abort (or died): only then may the scheduler reuse its pages.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch
import zmq

from pdserve.kvtransfer import control as C
from pdserve.kvtransfer.aux import AuxSlots
from pdserve.kvtransfer.backends import ONE_SIDED_BACKENDS
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.decode_engines import ReceivingEngines
from pdserve.kvtransfer.descriptors import DST, NUM
from pdserve.kvtransfer.engine import ChunkHeader
from pdserve.kvtransfer.fingerprint import Fingerprint
from pdserve.kvtransfer.hosts import host_id
from pdserve.kvtransfer.poll import KVPoll
from pdserve.kvtransfer.rank_pools import PoolSet
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer
from pdserve.kvtransfer.trace import stamp

log = logging.getLogger("pdserve.kvtransfer")


class _Views(Sequence[torch.Tensor]):
    """The destination views of a chunk, one per descriptor of each lane in turn, each built
    when it is read."""

    def __init__(self, lanes: list[torch.Tensor], descs: Any) -> None:
        self._lanes = lanes
        self._runs = descs[:, [DST, NUM]].tolist()

    def __len__(self) -> int:
        return len(self._lanes) * len(self._runs)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        lane, k = divmod(i, len(self._runs))
        d, n = self._runs[k]
        return self._lanes[lane][d:d + n]


@dataclass
class _PrefillPeer:
    addr: str
    sock: zmq.Socket
    last_seen: float
    backend: str = ""  # set by HELLO_OK; "" while the handshake is pending
    rooms: set[int] = field(default_factory=set)
    queued: list[int] = field(default_factory=list)  # rooms to REGISTER after HELLO_OK


class DecodeSide:
    def __init__(self, pools: PoolSet, config: TransferConfig, fingerprint: Fingerprint,
                 offers: list[str], eager: list[str], shm: ShmPoolBuffer | None) -> None:
        pool = pools.tensors[0]
        self.pool = pool
        self.lanes = pools.tensors  # every tensor-parallel rank's pool (lanes.py)
        self.num_pool_pages = int(pool.shape[0])
        self.page_bytes = pool[0].numel() * pool.element_size()
        self.config = config
        self.fingerprint = fingerprint
        self.on_change: Callable[[], None] | None = None  # given to every room (RoomState)
        self.host = host_id(config.host_id)
        self.aux_slots = AuxSlots(config.num_aux_slots)
        self._lock = threading.Lock()  # guards _receivers
        self._receivers: dict[int, KVReceiver] = {}
        self._aborting: dict[int, tuple[KVReceiver, str, float]] = {}  # control loop only
        self._peers: dict[str, _PrefillPeer] = {}  # control loop only
        # Engines may place chunks as soon as they start: the room tables exist first.
        self.engines = ReceivingEngines(offers, eager, pools, self.aux_slots.buffer, config,
                                        self, shm)
        self.loop = C.ControlLoop(self._tick, min(0.05, config.heartbeat_interval_s / 4),
                                  "kv-decode-control")
        self._last_ping = 0.0
        self.loop.start()

    # -- scheduler-facing -----------------------------------------------------------------
    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        r = KVReceiver(room, bootstrap_addr, self)
        with self._lock:
            if room in self._receivers:
                raise ValueError(f"room: {room} already has a receiver")
            self._receivers[room] = r
        self.loop.call(lambda: self._peer(bootstrap_addr).rooms.add(room))
        return r

    def register(self, r: KVReceiver) -> None:
        slot = self.aux_slots.alloc()
        if slot is None:
            r.abort(f"num_aux_slots: all {self.config.num_aux_slots} aux slots in use")
            return
        r.aux_slot = slot

        def _go() -> None:
            peer = self._peer(r.bootstrap_addr)
            if peer.backend:
                self._send_register(peer, r)
            else:
                peer.queued.append(r.room)

        self.loop.call(_go)

    def fail_room(self, r: KVReceiver, reason: str, tell_peer: bool) -> None:
        if r.state.done:
            return
        if tell_peer and r.aux_slot >= 0:  # registered (or about to be): prefill must know

            def _go() -> None:
                peer = self._peers.get(r.bootstrap_addr)
                one_sided = peer is not None and peer.backend in ONE_SIDED_BACKENDS
                if peer is not None:
                    C_body = {"room": r.room, "reason": reason, "want_ack": one_sided}
                    self._send(peer, C.ABORT, C_body)
                if one_sided and r.room not in self._aborting:
                    self._aborting[r.room] = (r, reason, time.monotonic())
                else:
                    self._finish_fail(r, reason)

            self.loop.call(_go)
        else:
            self._finish_fail(r, reason)

    def _finish_fail(self, r: KVReceiver, reason: str) -> None:
        with r.lock:  # waits for a chunk being placed; afterwards nothing writes its pages
            failed = r.state.fail(reason)
        if failed:
            self._release(r)

    def registered_regions(self) -> list[str]:
        return self.engines.registered()

    def close(self) -> None:
        def _bye() -> None:
            for peer in self._peers.values():
                self._send(peer, C.BYE, {})
            with self._lock:
                receivers = list(self._receivers.values())
            for r in receivers:
                self._finish_fail(r, "decode worker closing")

        self.loop.stop(_bye)
        self.engines.close()

    # -- engine-facing (ReceiveHandler) ---------------------------------------------------
    def place_chunk(self, peer: str, header: ChunkHeader, nbytes: list[int] | None,
                    write: Callable[[list[torch.Tensor]], None]) -> bool:
        with self._lock:
            r = self._receivers.get(header.room)
        if r is None:
            return False  # late message for a finished room: dropped
        with r.lock:
            if r.state.done or r.room in self._aborting:
                return False
            err = r.check_chunk(header, nbytes, self.page_bytes, len(self.lanes))
            if err is None:
                r.state.advance(KVPoll.Transferring)
                # One-sided chunks (nbytes None) are already in place, and ucx scatters from
                # its staging buffer: views are built only where read (~1-10 us each).
                # Payloads come rank by rank.
                write([] if nbytes is None else _Views(self.lanes, header.descs))
                complete = r.mark_arrived(header)
        if err is not None:
            r.abort(f"rejected chunk {header.seq}: {err}")
            return False
        if complete and r.state.advance(KVPoll.Success):
            stamp("success", r.room)
            self._release(r)
            self.loop.call(lambda: self._send_to(r.bootstrap_addr, C.ACK, {"room": r.room}))
        return True

    # -- control loop ---------------------------------------------------------------------
    def _release(self, r: KVReceiver) -> None:
        with self._lock:
            self._receivers.pop(r.room, None)
        if r.aux_slot >= 0:
            slot, r.aux_slot = r.aux_slot, -1
            self.aux_slots.free(slot)
        self.loop.call(lambda: self._peers[r.bootstrap_addr].rooms.discard(r.room)
                       if r.bootstrap_addr in self._peers else None)

    def _peer(self, addr: str) -> _PrefillPeer:
        peer = self._peers.get(addr)
        if peer is None:
            sock = self.loop.ctx.socket(zmq.DEALER)
            # A fresh identity per connection: a ROUTER ignores a newcomer with the identity of
            # a peer it has not seen leave (a reconnect right after a REFUSE went unanswered).
            sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(16))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{addr}")
            peer = _PrefillPeer(addr, sock, time.monotonic())
            self._peers[addr] = peer
            self.loop.add_socket(sock, lambda frames, p=peer: self._on_message(p, frames))
            self._hello(peer)
        return peer

    def _hello(self, peer: _PrefillPeer) -> None:
        self._send(peer, C.HELLO, {"fingerprint": self.fingerprint.to_dict(),
                                   "host": self.host, **self.engines.hello()})

    def _on_need(self, peer: _PrefillPeer, backend: str) -> None:
        """Prefill chose an engine that is not running here: start it, then say hello again
        (with it, or without it in the offer if it failed to start)."""

        def _again(err: str | None) -> None:
            del err  # logged by the engines; the new HELLO no longer offers it
            self.loop.call(lambda: self._hello(peer) if self._peers.get(peer.addr) is peer
                           else None)

        self.engines.start(backend, _again)

    def _send(self, peer: _PrefillPeer, kind: bytes, body: dict[str, Any], *blobs: bytes) -> None:
        try:
            peer.sock.send_multipart(C.pack(kind, body, *blobs), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # queue full or closed: heartbeats decide

    def _send_to(self, addr: str, kind: bytes, body: dict[str, Any]) -> None:
        peer = self._peers.get(addr)
        if peer is not None:
            self._send(peer, kind, body)

    def _send_register(self, peer: _PrefillPeer, r: KVReceiver) -> None:
        if r.state.done or r.aux_slot < 0:
            return
        self._send(peer, C.REGISTER, {"room": r.room, "aux_slot": r.aux_slot},
                   C.pages_blob(r.dst_pages))
        r.state.advance(KVPoll.WaitingForInput)

    def _on_message(self, peer: _PrefillPeer, frames: list[bytes]) -> None:
        kind, body, blobs = C.unpack(frames)
        peer.last_seen = time.monotonic()
        if kind == C.HELLO_OK:
            peer.backend = str(body["backend"])
            log.info("kv transfer with prefill %s (host %r): %s", peer.addr, body.get("host"),
                     body.get("reason", peer.backend))
            for room in peer.queued:
                with self._lock:
                    r = self._receivers.get(room)
                if r is not None:
                    self._send_register(peer, r)
            peer.queued.clear()
        elif kind == C.NEED:
            self._on_need(peer, str(body["backend"]))
        elif kind == C.REFUSE:
            self._drop_peer(peer, f"prefill {peer.addr} refused: {body.get('reason')}")
        elif kind == C.ABORT:
            room = int(body["room"])
            pending = self._aborting.pop(room, None)
            with self._lock:
                r = self._receivers.get(room)
            if pending is not None:
                self._finish_fail(pending[0], pending[1])
            elif r is not None:
                self._finish_fail(r, f"prefill aborted: {body.get('reason')}")
        elif kind == C.PONG:
            now = time.monotonic()
            with self._lock:
                for room in body.get("rooms", ()):
                    r = self._receivers.get(int(room))
                    if r is not None:
                        r.queued_at_peer = now
        elif kind == C.NOTIFY:  # one-sided engines without their own notification channel
            eng = self.engines.get(peer.backend)
            if eng is not None and eng.one_sided and blobs:
                eng.deliver(blobs[0], blobs[1] if len(blobs) > 1 else b"")

    def _queued_rooms(self) -> dict[str, list[int]]:
        """Rooms waiting in decode's own queue (no pages yet), by prefill address."""
        by_addr: dict[str, list[int]] = {}
        with self._lock:
            for r in self._receivers.values():
                if r.queued:
                    by_addr.setdefault(r.bootstrap_addr, []).append(r.room)
        return by_addr

    def _drop_peer(self, peer: _PrefillPeer, reason: str) -> None:
        self._peers.pop(peer.addr, None)
        self.loop.remove_socket(peer.sock)
        with self._lock:
            rooms = [self._receivers[r] for r in peer.rooms if r in self._receivers]
        for r in rooms:
            self._aborting.pop(r.room, None)
            self._finish_fail(r, reason)

    def _tick(self) -> None:
        now, cfg = time.monotonic(), self.config
        if now - self._last_ping >= cfg.heartbeat_interval_s:
            self._last_ping = now
            queued = self._queued_rooms()
            for peer in self._peers.values():
                rooms = queued.get(peer.addr)
                self._send(peer, C.PING, {"queued": rooms} if rooms else {})
        for peer in list(self._peers.values()):
            if now - peer.last_seen > cfg.heartbeat_window_s:
                self._drop_peer(peer, f"prefill {peer.addr} silent for "
                                      f"{now - peer.last_seen:.1f}s (heartbeat window "
                                      f"{cfg.heartbeat_window_s:.1f}s)")
        for room, (r, reason, t) in list(self._aborting.items()):
            if now - t > cfg.heartbeat_window_s:  # prefill alive but mute: give up waiting
                del self._aborting[room]
                self._finish_fail(r, reason)
        with self._lock:
            receivers = list(self._receivers.values())
        for r in receivers:
            st, since = r.state.status, r.state.since
            if st == KVPoll.Bootstrapping and not r.queued and \
                    now - max(since, r.init_at) > cfg.bootstrap_timeout_s:
                r.abort(f"bootstrap timeout ({cfg.bootstrap_timeout_s}s)")
            elif st == KVPoll.WaitingForInput and \
                    now - max(since, r.queued_at_peer) > cfg.waiting_timeout_s:
                r.abort(f"waiting timeout ({cfg.waiting_timeout_s}s): no pages arrived")
            elif st == KVPoll.Transferring and now - r.state.progress > cfg.transfer_timeout_s:
                r.abort(f"transfer timeout ({cfg.transfer_timeout_s}s)")
