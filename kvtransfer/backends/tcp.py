"""`tcp` backend over pyzmq: host memory, any pair of hosts; the dependable fallback.

One message per chunk: a header frame then one frame per descriptor, sent zero-copy from the
sender's pool; for a decode worker of several tensor-parallel ranks, a frame per descriptor per
rank, rank by rank (every rank's part of a chunk in one message). The receiver validates the
header before placing a byte; frames of a rejected chunk are dropped. Threads: the receive
thread owns the ROUTER socket; the caller's transfer thread owns every DEALER (ZMQ sockets are
never shared between threads).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import zmq

from pdserve.kvtransfer.engine import ChunkHeader, ReceiveHandler, TransferEngine
from pdserve.kvtransfer.lanes import Part

log = logging.getLogger("pdserve.kvtransfer")


def _bytes_view(t: torch.Tensor) -> Any:
    """A zero-copy buffer over a contiguous host tensor (any dtype, bf16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class TcpEngine(TransferEngine):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", send_timeout_s: float = 30.0, **_: Any) -> None:
        super().__init__()
        self._host = host
        self._send_timeout_s = send_timeout_s
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dealers: dict[str, zmq.Socket] = {}  # owned by the transfer thread
        self._addr: str | None = None

    # -- receiving ------------------------------------------------------------------------
    def start_receiver(self, handler: ReceiveHandler) -> dict[str, Any]:
        if self._thread is None:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port(f"tcp://{self._host}")
            self._addr = f"tcp://{self._host}:{port}"
            self._thread = threading.Thread(target=self._recv_loop, args=(sock, handler),
                                            name="kv-tcp-recv", daemon=True)
            self._thread.start()
        return {"addr": self._addr}

    def _recv_loop(self, sock: zmq.Socket, handler: ReceiveHandler) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart(copy=False)
                peer = bytes(frames[0].bytes).hex()
                try:
                    header = ChunkHeader.from_bytes(frames[1].bytes)
                except (ValueError, KeyError, TypeError):
                    log.warning("tcp: malformed chunk header dropped")
                    continue  # never written
                payload = frames[2:]

                def _write(views: list[torch.Tensor], payload: list[Any] = payload) -> None:
                    for view, frame in zip(views, payload):
                        if len(frame.buffer):
                            src = torch.frombuffer(frame.buffer, dtype=torch.uint8)
                            view.reshape(-1).view(torch.uint8).copy_(src)

                handler.place_chunk(peer, header, [len(f.buffer) for f in payload], _write)
        finally:
            sock.close(0)

    # -- sending --------------------------------------------------------------------------
    def write(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> None:
        self._send(peer, peer_info, header, [(self.region("kv"), header.descs)])

    def write_lanes(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader,
                    parts: list[Part]) -> None:
        ordered = sorted(parts, key=lambda p: p.lane)
        if [p.lane for p in ordered] != list(range(len(ordered))):
            raise ValueError(f"parts: lanes {[p.lane for p in ordered]}, expected every rank")
        self._send(peer, peer_info, header, [(p.src, p.descs) for p in ordered])

    def _send(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader,
              sources: list[tuple[torch.Tensor, Any]]) -> None:
        sock = self._dealers.get(peer)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(self._send_timeout_s * 1000))
            sock.connect(peer_info["addr"])
            self._dealers[peer] = sock
        frames: list[Any] = [header.to_bytes()]
        for pool, descs in sources:
            for s, _, n, _ in descs.tolist():
                src = pool[s:s + n]
                frames.append(_bytes_view(src if src.device.type == "cpu" else src.cpu()))
        tracker = sock.send_multipart(frames, copy=False, track=True)
        # The pages stay owned by the request until Success, but the caller may reuse them
        # after write() returns: wait until ZMQ has let go of the buffers.
        tracker.wait(self._send_timeout_s)

    def drop_peer(self, peer: str) -> None:
        sock = self._dealers.pop(peer, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for peer in list(self._dealers):
            self.drop_peer(peer)
        self._ctx.term()
        super().close()
