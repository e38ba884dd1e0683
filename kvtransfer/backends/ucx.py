"""`ucx` backend over ucxx (UCX picks cuda_ipc/NVLink, RDMA, shm or TCP).

Where the receiver maps its pool for remote writes (the default), a chunk's pages are put
one-sided from the sender's pool into the receiver's by the transfer thread, and its header
follows over the control channel (ucx_put.py).

Otherwise (`PDSERVE_UCX_RMA=0` on the receiver, or a libucp without RMA) it moves as tagged
messages, each costing tens of microseconds on the host and about a millisecond of latency
between GPU processes, so a chunk moves as a few large messages (staging.py `message_bytes`),
each gathered into one of IN_FLIGHT staging buffers on the sender (or sent straight from the
pool when its pages are one run), none larger than the receive buffers the receiver
announced. A chunk's headers go first, as one frame on the endpoint's default tag
(ucx_frames.py), before its payloads are gathered; each payload goes under its own tag (a
count both sides keep per endpoint) without waiting for the one before, so a chunk's messages
are on the wire together. The receiver (ucx_recv.py) has the receives of the next payloads
posted before their headers come, and lands each in order: checked against the room,
scattered into the destination pages, or dropped (the pool is never written by a rejected
piece).

The connection to a peer is made at handshake (`connect`), not on a request's path, and warmed
(one-sided: one put into the peer's page 0; staged: one message from each buffer a transfer
uses, the staging buffers and the pool, into the receiver's buffers, made at their full size
up front), so that UCX's endpoint wire-up, its registration caches and, on GPUs, the CUDA IPC
mappings are in place before the first room.
Threads: the process's one ucx loop thread (ucx_loop.py: ucxx initialised there with Python
futures, so an idle loop sleeps instead of spinning, and polling completions itself while a
transfer is under way) owns every ucxx object and does all of a staged transfer's work
(gathers, sends; receives, scatters); write() runs on the caller's transfer thread, cuts the
chunk into pieces and waits for the one coroutine that sends them, so a chunk's pieces never
change threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

import torch

from pdserve.kvtransfer.backends.staging import (
    IN_FLIGHT,
    event_done,
    gather,
    message_bytes,
    one_run,
    piece_bytes,
    warm_copies,
)
from pdserve.kvtransfer.backends.staging import split as split_pieces
from pdserve.kvtransfer.backends.ucx_frames import pack
from pdserve.kvtransfer.backends.ucx_loop import hot, ucx_loop
from pdserve.kvtransfer.backends.ucx_put import PutSender, offer
from pdserve.kvtransfer.backends.ucx_recv import WARM, serve
from pdserve.kvtransfer.backends.ucx_recv import as_ucx as _buf
from pdserve.kvtransfer.descriptors import NUM, SRC, run_pages
from pdserve.kvtransfer.engine import ChunkHeader, ReceiveHandler, TransferEngine, count_landed
from pdserve.kvtransfer.trace import stamp

log = logging.getLogger("pdserve.kvtransfer")


def _fits(pool: torch.Tensor, peer_info: dict[str, Any]) -> int:
    """The largest message the peer's receive buffers take (whole pages, at least one)."""
    page = pool[0].numel() * pool.element_size()
    announced = int(peer_info.get("message_bytes", 0))
    return max(page, announced // page * page) if announced else pool.numel() * pool.element_size()


class UcxEngine(TransferEngine):
    name = "ucx"
    one_sided = True  # where the receiver offers puts (notify() says which chunks)

    def __init__(self, host: str = "127.0.0.1", send_timeout_s: float = 30.0,
                 stage_bytes: int = 0, **_: Any) -> None:
        super().__init__()
        import ucxx  # imported here: a host without ucxx can still use the other backends

        self._ucxx = ucxx
        self._host = host
        self._timeout = send_timeout_s
        self._stage_bytes = stage_bytes
        self._loop = ucx_loop()  # the process's one, shared with its other ucx engines
        self._listener: Any = None
        self._eps: dict[str, Any] = {}  # sender: peer -> endpoint (loop thread only)
        # sender: peer -> the tag of its endpoint's next payload (the receiver counts alike)
        self._tags: dict[str, int] = {}
        self._tags_lock = threading.Lock()
        # sender: peer -> held while a warm-up or a chunk sends (loop thread only): their
        # headers and tags must not interleave
        self._sending: dict[str, asyncio.Lock] = {}
        self._recv_eps: list[Any] = []
        self._stages: list[torch.Tensor] = []  # sender: IN_FLIGHT staging buffers
        self._ready: list[Any] = []  # sender, GPU: an event after each buffer's gather
        self._copiers: dict = {}  # sender: the gather kernels of the pool into each buffer
        self._puts = PutSender(send_timeout_s)  # sender: keys on the loop, puts on the caller
        self._mapping: Any = None  # receiver: its pool mapped for them
        self._rma: dict[str, Any] = {}  # receiver: what its start_receiver info says of it
        self._handler: ReceiveHandler | None = None

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- receiving (ucx_recv.py) ---------------------------------------------------------
    def start_receiver(self, handler: ReceiveHandler) -> dict[str, Any]:
        nbytes = piece_bytes(self.region("kv"), self._stage_bytes)
        self._handler = handler
        if self._listener is None:
            async def _on_connect(ep: Any) -> None:
                self._recv_eps.append(ep)
                await serve(ep, self.region("kv"), nbytes, handler)

            async def _listen() -> tuple[Any, tuple[Any, dict[str, Any]]]:
                return self._ucxx.create_listener(_on_connect), offer(self.region("kv"))

            self._listener, (self._mapping, self._rma) = self._run(_listen(), 30)
        return {"host": self._host, "port": int(self._listener.port), "message_bytes": nbytes,
                **self._rma}

    # -- sending --------------------------------------------------------------------------
    async def _endpoint(self, peer: str, info: dict[str, Any]) -> Any:
        ep = self._eps.get(peer)
        if ep is None or ep.closed:
            self._puts.forget(peer)  # the old endpoint's key, before anything else
            ep = await self._ucxx.create_endpoint(info["host"], int(info["port"]))
            self._puts.attach(peer, ep, info)
            self._eps[peer] = ep
            with self._tags_lock:
                self._tags[peer] = 0  # a new endpoint: the receiver counts from 0
        return ep

    def _tag(self, peer: str) -> int:
        with self._tags_lock:
            tag = self._tags.get(peer, 0)
            self._tags[peer] = tag + 1
        return tag

    def _staging(self, pool: torch.Tensor, b: int, pages: int) -> torch.Tensor:
        if not self._stages:
            n = max(1, piece_bytes(pool, self._stage_bytes) // (pool[0].numel()
                                                                 * pool.element_size()))
            self._stages = [torch.empty((n, *pool.shape[1:]), dtype=pool.dtype,
                                        device=pool.device) for _ in range(IN_FLIGHT)]
            if pool.is_cuda:
                self._ready = [torch.cuda.Event() for _ in range(IN_FLIGHT)]
        if self._stages[b].shape[0] < pages:  # one descriptor larger than a piece
            self._stages[b] = torch.empty((pages, *pool.shape[1:]), dtype=pool.dtype,
                                          device=pool.device)
            self._copiers.clear()
        return self._stages[b]

    def connect(self, peer: str, peer_info: dict[str, Any]) -> Future:
        """The endpoint, then a warm-up on the engine's loop; the returned future says when.
        One-sided: one put (`PutSender.warm`) and an empty warm-up frame. Staged (also where
        that put failed): one warm-up message from each staging buffer and from the pool,
        which only reads the buffers (a gather for another peer meanwhile changes nothing the
        receiver keeps)."""
        pool = self.region("kv")
        puts = self._puts.wanted(peer, pool, peer_info)  # a page size that differs: raises
        warm = [] if puts else self._staged_warm(pool, peer_info)

        async def _warm() -> None:
            async with self._sending.setdefault(peer, asyncio.Lock()):
                await _warm_locked(warm)

        async def _warm_locked(warm: list[torch.Tensor]) -> None:
            ep = await self._endpoint(peer, peer_info)
            with hot():
                self._puts.warm(peer, pool, peer_info)  # blocks the loop for one flush
                if puts and not self._puts.wanted(peer, pool, peer_info):  # the put failed
                    warm = self._staged_warm(pool, peer_info)
                sizes = [t.numel() * t.element_size() for t in warm] or [0]
                for msg in pack([WARM + n.to_bytes(8, "little") for n in sizes]):
                    await ep.send(msg)
                for t in warm:
                    await ep.send(_buf(t), tag=self._tag(peer))

        async def _go() -> None:
            try:
                await asyncio.wait_for(_warm(), self._timeout)
            except BaseException:
                await self._close_ep(peer)
                raise

        return asyncio.run_coroutine_threadsafe(_go(), self._loop)

    def _staged_warm(self, pool: torch.Tensor, peer_info: dict[str, Any]) -> list[torch.Tensor]:
        """What a staged connection's warm-up sends: a message from each buffer it uses."""
        fits = _fits(pool, peer_info) // (pool[0].numel() * pool.element_size())
        warm = [*(self._staging(pool, b, 1)[:fits] for b in range(IN_FLIGHT)), pool[:1]]
        with torch.cuda.device(pool.device) if pool.is_cuda else nullcontext():
            warm_copies(pool, warm[0])
        return warm

    def write(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> None:
        """One-sided where the peer offers it: put from this thread (`PutSender.write`).
        Staged: cut into pieces sent by one coroutine on the engine's loop (`_send`); this
        thread only cuts the chunk and waits, so no piece waits for a hand-over between
        threads."""
        pool = self.region("kv")
        puts = self._puts.wanted(peer, pool, peer_info)
        if puts and not self._puts.has_key(peer):
            self._wait(peer, asyncio.run_coroutine_threadsafe(  # write connects on its own
                self._ensure_endpoint(peer, peer_info), self._loop))
            puts = self._puts.wanted(peer, pool, peer_info)  # unpacking the key may fail
        if puts:
            if pool.is_cuda:
                torch.cuda.current_stream(pool.device).synchronize()  # the pages are written
            try:
                self._puts.write(peer, pool, peer_info, header)
            except BaseException:
                self.drop_peer(peer)  # a put may still be in flight: start afresh
                raise
            return
        page_bytes = pool[0].numel() * pool.element_size()
        total = int(header.descs[:, NUM].sum()) * page_bytes
        whole = len(header.descs) > 0 and one_run(run_pages(header.descs, SRC))
        size = message_bytes(pool, self._stage_bytes, total, contiguous=whole)
        pieces = split_pieces(header, page_bytes, min(size, _fits(pool, peer_info)))
        first = self._launch(pool, pieces[0], 0)  # runs on the GPU during the hand-over
        self._wait(peer, asyncio.run_coroutine_threadsafe(
            self._send_locked(peer, peer_info, pool, pieces, first), self._loop))

    def _wait(self, peer: str, done: Future) -> None:
        """A chunk's coroutine, within the send timeout; on failure the peer's connection
        is dropped (a send may still read the buffers: start afresh)."""
        try:
            try:
                done.result(self._timeout)
            except TimeoutError:
                if done.done():  # the send's own error
                    raise
                raise TimeoutError("ucx: send not done in time") from None
        except BaseException:
            done.cancel()
            self.drop_peer(peer)
            raise

    def notify(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> bool:
        """Put chunks: False, so the manager sends the header over the control channel (from
        this thread; the receiver counts it in `deliver`). A staged chunk's header went first."""
        return not self._puts.wanted(peer, self.region("kv"), peer_info)

    def paths(self) -> dict[str, str]:
        return {peer: self._puts.path(peer) for peer in list(self._eps)}

    def deliver(self, header: bytes, token: bytes = b"") -> None:
        count_landed(self._handler, self.name, header)

    async def _ensure_endpoint(self, peer: str, info: dict[str, Any]) -> None:
        async with self._sending.setdefault(peer, asyncio.Lock()):
            await self._endpoint(peer, info)

    async def _send_locked(self, peer: str, info: dict[str, Any], pool: torch.Tensor,
                           pieces: list[ChunkHeader], first: torch.Tensor | None) -> None:
        async with self._sending.setdefault(peer, asyncio.Lock()):
            with hot():
                await self._send(peer, info, pool, pieces, first)

    async def _send(self, peer: str, info: dict[str, Any], pool: torch.Tensor,
                    pieces: list[ChunkHeader], first: torch.Tensor | None) -> None:
        """The pieces' headers first, as one frame on the endpoint's default tag (`_headers`),
        so that the receiver posts each payload's receive while this side gathers it. Each
        piece's payload: gathered into staging buffer k % IN_FLIGHT (once that buffer's
        previous send is done) or taken from the pool when its pages are one run, then sent
        under its own tag without waiting for the one before. So up to IN_FLIGHT payloads are
        on the wire at once, and the gather of one runs while the other moves."""
        stamp("looped", pieces[0].room)
        ep = await self._endpoint(peer, info)
        busy: list[asyncio.Future | None] = [None] * IN_FLIGHT  # the send reading buffer b
        sends: list[asyncio.Future] = [asyncio.ensure_future(self._headers(ep, pieces))]
        try:
            for k, piece in enumerate(pieces):
                b = k % IN_FLIGHT
                if busy[b] is not None:
                    await busy[b]
                    busy[b] = None
                payload = first if k == 0 else self._launch(pool, piece, b)
                if payload is not None:
                    if self._ready:  # a GPU: the gather has run (an unused event has too)
                        await event_done(self._ready[b])
                    stamp("staged", piece.room)
                    task = asyncio.ensure_future(ep.send(_buf(payload), tag=self._tag(peer)))
                    busy[b] = task
                    sends.append(task)
            await asyncio.gather(*sends)
        except BaseException:
            for t in sends:
                t.cancel()
            raise

    @staticmethod
    async def _headers(ep: Any, pieces: list[ChunkHeader]) -> None:
        """A chunk's headers as one frame (two messages where they do not fit one, which
        must not interleave with another chunk's: the caller holds the peer's lock)."""
        for msg in pack([piece.to_bytes() for piece in pieces]):
            await ep.send(msg)

    def _launch(self, pool: torch.Tensor, piece: ChunkHeader, b: int) -> torch.Tensor | None:
        """The piece's payload: the pool slice when its pages are one run, else gathered into
        staging buffer b, on a GPU asynchronously (the gather's event `_ready[b]` says when
        UCX, which reads the buffer outside any stream, may send it)."""
        if len(piece.descs) == 0:
            return None
        pages = run_pages(piece.descs, SRC)
        if one_run(pages):
            return pool[int(pages[0]):int(pages[0]) + len(pages)]
        out = gather(pool, piece.descs, self._staging(pool, b, len(pages)), self._copiers)
        stamp("issued", piece.room)
        if pool.is_cuda:
            self._ready[b].record(torch.cuda.current_stream(pool.device))
        return out

    async def _close_ep(self, peer: str) -> None:
        self._puts.forget(peer)
        ep = self._eps.pop(peer, None)
        if ep is not None:
            await ep.close()

    def drop_peer(self, peer: str) -> None:
        try:
            self._run(self._close_ep(peer), 5)
        except Exception as e:  # noqa: BLE001
            log.debug("ucx drop_peer: %s", e)

    def close(self) -> None:
        async def _close() -> None:
            self._puts.close()
            for ep in [*self._eps.values(), *self._recv_eps]:
                try:
                    await ep.close()
                except Exception as e:  # noqa: BLE001
                    log.debug("ucx close: %s", e)
            self._eps.clear()
            self._recv_eps.clear()
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            if self._mapping is not None:  # no endpoint can write it any more
                self._mapping.close()
                self._mapping = None

        try:
            self._run(_close(), 10)
        finally:
            self._stages = []
            self._copiers.clear()
            super().close()
