"""The ucx backend's receiving side: one task per sender's endpoint.

Once its first payload is announced, the receives of the endpoint's next IN_FLIGHT payloads
are always posted, each into the ring buffer its tag names (tag k: buffer k % IN_FLIGHT),
before their headers are read. So a payload moves as soon as the sender sends it: UCX
matches it to the posted receive and pulls its bytes in its own progress thread, while the
receiver's loop may still be asleep (an idle loop wakes through ucxx's notifier thread, a
hand-over that otherwise stood between a chunk's header and the receive of its payload). An
endpoint whose sender puts one-sided announces no payload, and allocates no ring. The
headers then say where each landed payload goes: checked against the room and scattered into
the destination pages, or dropped (a rejected piece never writes the pool). A buffer's next
receive is posted once its scatter has run.

The receive buffers are of one size, which the receiver announces (`message_bytes` in its
start_receiver info); a sender cuts its messages to fit. A header or warm-up announcing more is
a protocol error: the endpoint is closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

import torch

from pdserve.kvtransfer.backends.staging import (
    IN_FLIGHT,
    RecvRing,
    event_done,
    scatter,
    scatter_index,
    warm_copies,
)
from pdserve.kvtransfer.backends.ucx_frames import FRAME_BYTES, announced, body_of, items
from pdserve.kvtransfer.backends.ucx_loop import hot
from pdserve.kvtransfer.descriptors import NUM
from pdserve.kvtransfer.engine import ChunkHeader, ReceiveHandler
from pdserve.kvtransfer.trace import stamp

log = logging.getLogger("pdserve.kvtransfer")
WARM = b"PDKVWARM"  # then u64 byte count: a warm-up payload follows, received and dropped


def as_ucx(t: torch.Tensor) -> Any:
    """What ucxx accepts: numpy for host memory, the tensor itself (cuda array) on GPU."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


async def serve(ep: Any, pool: torch.Tensor, nbytes: int, handler: ReceiveHandler) -> None:
    """Frames of headers in order; a frame's items all read first (sizes checked, scatter
    indices uploaded), then landed in order (payloads received into the posted buffers, so
    a later piece's index is on the GPU before its payload lands); until the endpoint closes
    or sends what the protocol refuses."""
    r = _Endpoint(ep, pool, nbytes, handler)
    frame = bytearray(FRAME_BYTES)
    try:
        while True:
            await ep.recv(frame)  # idle: sleeps until a sender's frame comes
            body = body_of(frame)
            with hot():
                big = announced(body)
                if big is not None:
                    whole = bytearray(big)
                    await ep.recv(whole)
                    body = bytes(whole)
                for item in [r.read(msg) for msg in items(body)]:
                    await r.land(item)
    except ValueError as e:  # a malformed or oversized message: this peer is cut off
        log.warning("ucx: closing a sender's endpoint: %s", e)
        await ep.close()
    except Exception as e:  # noqa: BLE001 - the peer went away
        log.debug("ucx receive endpoint closed: %s", e)
    finally:
        r.cancel()


class _Item(NamedTuple):
    """A frame's item once read: a piece's header (None for a warm-up), its payload's bytes,
    the bytes per descriptor and the uploaded scatter index."""

    header: ChunkHeader | None
    total: int
    nbytes: list[int] | None
    idx: torch.Tensor | None


class _Endpoint:
    """One sender's endpoint: the ring, the posted receives by tag, the next tag to land."""

    def __init__(self, ep: Any, pool: torch.Tensor, nbytes: int,
                 handler: ReceiveHandler) -> None:
        self._ep, self._pool, self._handler = ep, pool, handler
        self._who = f"ucx:{id(ep)}"
        self._ring = RecvRing(pool, nbytes)
        self._page = pool[0].numel() * pool.element_size()
        self._tag = 0  # the next payload's tag (the sender counts alike)
        self._posted: dict[int, asyncio.Future] = {}

    def _start(self) -> None:
        """The first payloads' receives, posted when the first item that carries one is read
        (a staged sender's warm-up): a sender that puts one-sided sends none, and its
        endpoint never allocates the ring."""
        if not self._posted and self._tag == 0:
            for t in range(IN_FLIGHT):
                self._post(t, None)

    def _post(self, tag: int, after: torch.cuda.Event | None) -> None:
        """The receive of payload `tag` into its buffer, posted once `after` (the scatter that
        last read the buffer) has run."""
        buf = as_ucx(self._ring.buf(tag % IN_FLIGHT))

        async def _recv() -> None:
            await event_done(after)
            await self._ep.recv(buf, tag=tag)

        self._posted[tag] = asyncio.ensure_future(_recv())

    async def _payload(self) -> int:
        """Wait for the next payload; its tag."""
        t, self._tag = self._tag, self._tag + 1
        await self._posted.pop(t)
        return t

    def read(self, msg: bytes) -> _Item:
        """One item of a frame, read as soon as the frame comes: a warm-up's size, or a
        piece's header with its destination index uploaded (while earlier pieces land)."""
        if msg.startswith(WARM):
            n = int.from_bytes(msg[len(WARM):], "little")
            if n % self._page:
                raise ValueError(f"warm-up of {n} bytes is not whole pages")
            if self._fits(n):
                self._start()
            return _Item(None, n, None, None)
        header = ChunkHeader.from_bytes(msg)
        stamp("header", header.room)
        nbytes = [n * self._page for n in header.descs[:, NUM].tolist()]
        total = self._fits(sum(nbytes))
        idx = None
        if total:
            self._start()
            idx = scatter_index(self._pool, header.descs)
        return _Item(header, total, nbytes, idx)

    def _fits(self, n: int) -> int:
        if n > self._ring.nbytes:
            raise ValueError(f"a message of {n} bytes exceeds the {self._ring.nbytes}-byte "
                             "receive buffers")
        return n

    async def land(self, item: _Item) -> None:
        """A read item's payload received, then dropped (a warm-up) or checked and placed."""
        ring, header = self._ring, item.header
        t = await self._payload() if item.total else None
        if header is None:  # a warm-up
            if t is not None:
                warm_copies(self._pool, ring.pages(ring.buf(t % IN_FLIGHT)[:item.total]))
                self._post(t + IN_FLIGHT, None)  # warm_copies synchronized
            return
        stamp("received", header.room)
        done: list[torch.cuda.Event | None] = [None]

        def _write(views: list[torch.Tensor]) -> None:
            del views  # the same pages, scattered in one pass
            if t is None:
                return
            b = t % IN_FLIGHT
            scatter(ring.whole(b), self._pool, header.descs, ring.copiers, item.idx)
            done[0] = ring.scattered(b)
            stamp("copied", header.room)

        try:
            self._handler.place_chunk(self._who, header, item.nbytes, _write)
        finally:
            if t is not None:
                self._post(t + IN_FLIGHT, done[0])

    def cancel(self) -> None:
        """The posted receives, which no one will land."""
        for f in self._posted.values():
            f.cancel()
        self._posted.clear()
