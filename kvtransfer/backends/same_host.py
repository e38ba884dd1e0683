"""Same-host one-sided engines (shm, cuda_ipc) and their chunk notification channel.

The sender writes the pages itself; what is left is telling the receiver which chunk landed.
Over the control channel that takes four thread hand-offs (transfer thread -> prefill control
loop -> two ZMQ I/O threads -> decode control loop), each a scheduler wake-up that costs
milliseconds on a loaded host. The notification socket takes one: the transfer thread that
finished the copy writes the header into a Unix stream socket, and the decode thread blocked on
that socket validates and counts the chunk.

The socket file lives in /dev/shm (mode 0600; whoever may connect may write the pool segment
anyway) under a creator lock, so `shm_pool.sweep_stale_segments` removes it when its creator
dies. A peer that cannot reach it (no shared /dev/shm) gets its notifications over the control
channel instead. Messages: u32 length of the rest, u32 token length, completion token (the
engine's, e.g. a CUDA IPC event handle), ChunkHeader bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pdserve.kernels.page_copy import check_head_pools
from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.descriptors import coalesce
from pdserve.kvtransfer.engine import ReceiveHandler, TransferEngine
from pdserve.kvtransfer.shm_pool import SHM_DIR, hold_lock, lock_path
from pdserve.kvtransfer.trace import stamp

log = logging.getLogger("pdserve.kvtransfer")
_LEN = struct.Struct("<II")
MAX_MESSAGE = 1 << 27  # a chunk header of MAX_DESCS rows is 64 MiB


class NotifyListener:
    """Decode side: a listening Unix socket and one thread that reads length-prefixed messages
    from every connected sender, calling `on_message(header, token)` for each, in order."""

    def __init__(self, on_message: Callable[[bytes, bytes], None]) -> None:
        self._on_message = on_message
        name = f"pdkv_{secrets.token_hex(8)}"
        shm = os.path.isdir(SHM_DIR)
        self._lock_fd = hold_lock(name) if shm else None
        self._name = name
        self.path = f"{SHM_DIR if shm else tempfile.gettempdir()}/{name}.sock"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._rfd, self._wfd = os.pipe()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._sel.register(self._rfd, selectors.EVENT_READ)
        self._bufs: dict[socket.socket, bytearray] = {}
        self._thread = threading.Thread(target=self._run, name="kv-notify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.fileobj == self._rfd:
                    return
                if key.fileobj is self._sock:
                    with contextlib.suppress(BlockingIOError):
                        conn, _ = self._sock.accept()
                        conn.setblocking(False)
                        self._bufs[conn] = bytearray()
                        self._sel.register(conn, selectors.EVENT_READ)
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        buf = self._bufs[conn]
        buf += data
        while len(buf) >= _LEN.size:
            n, tlen = _LEN.unpack_from(buf)
            if n > MAX_MESSAGE or tlen > n:
                log.warning("notify: malformed message (length %d, token %d); connection "
                            "closed", n, tlen)
                data = b""
                break
            if len(buf) < _LEN.size + n:
                break
            token = bytes(buf[_LEN.size:_LEN.size + tlen])
            header = bytes(buf[_LEN.size + tlen:_LEN.size + n])
            del buf[:_LEN.size + n]
            try:
                self._on_message(header, token)
            except Exception:
                log.exception("notify: chunk notification dropped")
        if not data:  # peer closed (or misbehaved)
            self._close_conn(conn)

    def _close_conn(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        self._bufs.pop(conn, None)
        conn.close()

    def close(self) -> None:
        """Stop the thread, close every connection, unlink the socket and its lock."""
        if self._thread.is_alive():
            os.write(self._wfd, b"x")
            self._thread.join(timeout=5)
        for conn in list(self._bufs):
            self._close_conn(conn)
        self._sel.close()
        self._sock.close()
        os.close(self._rfd)
        os.close(self._wfd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path(self._name))
            os.close(self._lock_fd)
            self._lock_fd = None


class NotifySender:
    """Prefill side: one connected socket per peer, used by the transfer thread only. A peer
    whose socket cannot be reached is remembered as having no channel."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._socks: dict[str, socket.socket | None] = {}

    def send(self, peer: str, path: str, header: bytes, token: bytes) -> bool:
        if peer in self._socks and self._socks[peer] is None:
            return False
        sock = self._socks.get(peer)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            try:
                sock.connect(path)
            except OSError as e:
                sock.close()
                log.info("notify: %s unreachable (%s); using the control channel", path, e)
                self._socks[peer] = None
                return False
            self._socks[peer] = sock
        try:
            sock.sendall(b"".join((_LEN.pack(len(token) + len(header), len(token)), token,
                                   header)))
        except OSError:
            self.drop(peer)
            raise
        return True

    def drop(self, peer: str) -> None:
        sock = self._socks.pop(peer, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for peer in list(self._socks):
            self.drop(peer)


class SameHostEngine(TransferEngine):
    """Base of the one-sided engines: notification channel on both sides."""

    one_sided = True
    head_parts = True

    def __init__(self, send_timeout_s: float = 30.0) -> None:
        super().__init__()
        self._handler: ReceiveHandler | None = None
        self._listener: NotifyListener | None = None
        self._notifier = NotifySender(send_timeout_s)

    def _listen(self, handler: ReceiveHandler) -> dict[str, Any]:
        """Receiver: start the notification socket; returns its part of the peer info."""
        self._handler = handler
        if self._listener is None:
            self._listener = NotifyListener(self.deliver)
        return {"notify": self._listener.path}

    @staticmethod
    def _runs(peer: str, src: torch.Tensor, dst: torch.Tensor, descs: np.ndarray,
              heads: tuple[int, int, int] | None = None) -> np.ndarray:
        """The chunk's copies as (src_page, dst_page, num_pages) rows, runs merged again (the
        message-size cap means nothing to a copy); raises unless the peer's pool holds pages
        like ours (but for the heads, with `heads`) and every destination lies inside it."""
        if heads is not None:
            check_head_pools(src, dst, *heads)
        elif tuple(dst.shape[1:]) != tuple(src.shape[1:]) or dst.dtype != src.dtype:
            raise ValueError(f"pool of peer {peer}: pages {tuple(dst.shape[1:])} {dst.dtype} "
                             f"!= local {tuple(src.shape[1:])} {src.dtype}")
        runs = coalesce(descs)
        if len(runs) and (runs[:, 1].min() <= 0
                          or (runs[:, 1] + runs[:, 2]).max() > dst.shape[0]):
            raise ValueError(f"destination pages outside the pool of peer {peer} "
                             f"[1, {dst.shape[0]})")
        return runs

    @staticmethod
    def lane_info(peer_info: dict[str, Any], lane: int) -> dict[str, Any]:
        """How to reach the pool of the peer's tensor-parallel rank `lane`: its entry in the
        peer's `lanes`, or (a peer of one rank) the peer info itself."""
        lanes = peer_info.get("lanes")
        if lanes:
            return lanes[lane]
        if lane != 0:
            raise ValueError(f"lane: the peer has one pool, not a rank {lane}")
        return peer_info

    def _copy_heads(self, peer: str, src: torch.Tensor, dst: torch.Tensor, descs: np.ndarray,
                    heads: tuple[int, int, int]) -> None:
        """A range of heads of every run of pages: one strided copy per run."""
        s_head, d_head, num = heads
        for sp, dp, n in self._runs(peer, src, dst, descs, heads).tolist():
            dst[dp:dp + n, :, :, :, d_head:d_head + num].copy_(
                src[sp:sp + n, :, :, :, s_head:s_head + num], non_blocking=dst.is_cuda)

    def notify(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> bool:
        path = peer_info.get("notify")
        if not path:
            return False
        return self._notifier.send(peer, str(path), header.to_bytes(), self.completion())

    def deliver(self, header: bytes, token: bytes) -> None:
        try:
            h = ChunkHeader.from_bytes(header)
        except ValueError as e:
            log.warning("%s: malformed chunk notification dropped: %s", self.name, e)
            return
        stamp("received", h.room)

        def landed(views: object) -> None:
            # Called by place_chunk once the chunk passed its checks, so the checks overlap
            # the copy; the pages count as arrived only after the copy is done.
            if token:
                self.wait_completion(token)
            stamp("copied", h.room)

        if self._handler is not None:
            self._handler.place_chunk("local", h, None, landed)

    def drop_peer(self, peer: str) -> None:
        self._notifier.drop(peer)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._notifier.close()
        super().close()
