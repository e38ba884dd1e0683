"""The control channel: one thread owning every ZMQ control socket of a KVManager.

Prefill binds a ROUTER (the bootstrap endpoint); decode connects one DEALER per prefill worker.
Messages are `[type, json, *blobs]` (a ROUTER prepends the peer identity): page lists and
chunk headers travel as raw binary frames after the JSON body, never as JSON lists. Other
threads never touch a socket: they hand the loop a closure with `call()`, which wakes it
through a pipe, so control messages go out at once instead of on the next tick.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

log = logging.getLogger("pdserve.kvtransfer")

# Message types.
HELLO = b"HELLO"  # decode -> prefill: fingerprint, host, backends offered, running transports
HELLO_OK = b"HELLO_OK"  # prefill -> decode: chosen backend, why, prefill's host
NEED = b"NEED"  # prefill -> decode: start the chosen backend's engine, then HELLO again
REFUSE = b"REFUSE"  # prefill -> decode: handshake refused (reason names the field)
REGISTER = b"REGISTER"  # decode -> prefill: room, aux slot; blob: destination pages (int32)
ABORT = b"ABORT"  # either way: room, reason
NOTIFY = b"NOTIFY"  # prefill -> decode: a chunk was written one-sided; blobs: header, token
ACK = b"ACK"  # decode -> prefill: every page and the aux data of a room arrived
PING = b"PING"  # decode -> prefill heartbeat; names the rooms queued at decode (no pages yet)
PONG = b"PONG"  # prefill -> decode heartbeat reply; names the rooms queued at prefill
BYE = b"BYE"  # decode -> prefill: closing, fail my rooms now


MAX_BLOBS = 2


def pack(kind: bytes, body: dict[str, Any], *blobs: bytes) -> list[bytes]:
    return [kind, json.dumps(body).encode(), *blobs]


def unpack(frames: list[bytes]) -> tuple[bytes, dict[str, Any], list[bytes]]:
    if not 2 <= len(frames) <= 2 + MAX_BLOBS:
        raise ValueError(f"control message: expected 2 to {2 + MAX_BLOBS} frames, got "
                         f"{len(frames)}")
    body = json.loads(frames[1]) if frames[1] else {}
    if not isinstance(body, dict):
        raise TypeError("control message: body is not an object")
    return frames[0], body, frames[2:]


def pages_blob(pages: np.ndarray) -> bytes:
    """A page list as little-endian int32 (pool page numbers fit; checked)."""
    if len(pages) and (pages.min() < 0 or pages.max() > np.iinfo(np.int32).max):
        raise ValueError("pages: page numbers must fit in int32")
    return pages.astype("<i4").tobytes()


def blob_pages(blob: bytes) -> np.ndarray:
    """The inverse of pages_blob, strict about the length."""
    if len(blob) % 4:
        raise ValueError(f"page list: {len(blob)} bytes is not a whole number of int32")
    return np.frombuffer(blob, dtype="<i4").astype(np.int64)


class ControlLoop:
    """Polls registered sockets, runs queued closures, and calls `on_tick` every `tick_s`."""

    def __init__(self, on_tick: Callable[[], None], tick_s: float, name: str) -> None:
        self.ctx = zmq.Context()
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        self._poller = zmq.Poller()
        self._poller.register(self._rfd, zmq.POLLIN)
        self._handlers: dict[zmq.Socket, Callable[[list[bytes]], None]] = {}
        self._stop = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the loop thread (at once if already there)."""
        if self.in_loop:
            fn()
            return
        if self._closed:
            return  # the loop is gone: nothing left to talk to
        self._calls.put(fn)
        try:
            os.write(self._wfd, b"x")
        except OSError:
            pass  # closed: the loop is gone

    def add_socket(self, sock: zmq.Socket, handler: Callable[[list[bytes]], None]) -> None:
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket) -> None:
        if self._handlers.pop(sock, None) is not None:
            self._poller.unregister(sock)
        sock.close(linger=100)  # let a goodbye (ABORT/BYE) leave, never block longer

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop:
            timeout_ms = max(0.0, (next_tick - time.monotonic()) * 1000)
            for sock, _ in self._poller.poll(timeout_ms):
                if sock == self._rfd:
                    try:
                        os.read(self._rfd, 4096)
                    except BlockingIOError:
                        pass
                    continue
                handler = self._handlers.get(sock)
                if handler is None:
                    continue
                while sock in self._handlers:  # drain (a handler may remove its socket)
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        handler(frames)
                    except Exception:
                        log.exception("control message dropped")
            self._drain_calls()
            if time.monotonic() >= next_tick:
                try:
                    self._on_tick()
                except Exception:
                    log.exception("control tick failed")
                next_tick = time.monotonic() + self._tick_s
        self._drain_calls()
        for sock in list(self._handlers):
            self.remove_socket(sock)

    def _drain_calls(self) -> None:
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                log.exception("control call failed")

    def stop(self, final: Callable[[], None] | None = None) -> None:
        """Run `final` on the loop (goodbye messages), then stop, close sockets, free fds."""
        if final is not None:
            self.call(final)

        def _halt() -> None:
            self._stop = True

        self.call(_halt)
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._closed = True
        os.close(self._rfd)
        os.close(self._wfd)
        self.ctx.term()
