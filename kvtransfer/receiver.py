"""KVReceiver: the decode side of one room.

Bootstrapping until the handshake with prefill is done and the destination pages are
registered, WaitingForInput until the first chunk, Transferring until every registered page and
the aux data arrived (then decode acknowledges and the room is Success).
Ownership: the destination pages and the request slot belong to the decode scheduler; the
receiver holds one aux slot from init() until the room ends, and frees it itself.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.kvtransfer.aux import AuxData
from pdserve.kvtransfer.descriptors import NUM, POS, as_pages, run_pages, validate_dst
from pdserve.kvtransfer.engine import ChunkHeader
from pdserve.kvtransfer.poll import KVPoll, RoomState

if TYPE_CHECKING:
    from pdserve.kvtransfer.decode_side import DecodeSide


class KVReceiver:
    def __init__(self, room: int, bootstrap_addr: str, side: DecodeSide) -> None:
        self.room = room
        self.bootstrap_addr = bootstrap_addr
        self.state = RoomState(room, side.on_change)
        self._side = side
        self.dst_pages = np.empty(0, dtype=np.int64)
        self.aux_slot = -1
        self._aux: AuxData | None = None
        self.lock = threading.RLock()  # placement, arrival bookkeeping and failure
        self._arrived = np.zeros(0, dtype=bool)
        self._num_arrived = 0
        self._have_aux = False
        # Last heartbeat in which prefill listed this room as still queued (monotonic s).
        self.queued_at_peer = 0.0
        self.init_at = 0.0  # when init() registered the pages (0: still queued at decode)

    # -- scheduler-facing -----------------------------------------------------------------
    def poll(self) -> KVPoll:
        return self.state.status

    @property
    def failure_reason(self) -> str | None:
        return self.state.failure_reason

    @property
    def queued(self) -> bool:
        """Created but not init()ed: the request waits in decode's own queue for pages. Such
        a room has no bootstrap deadline here, and decode's heartbeats name it to prefill so
        that prefill's does not run either (the request's deadline still ends it)."""
        return self.init_at == 0.0 and not self.state.done

    @property
    def aux(self) -> AuxData | None:
        """The aux data; set once poll() is Success."""
        return self._aux

    def init(self, dst_pages: list[int] | Any) -> None:
        """Register the destination pages (decode allocated ceil(prompt_len / page_size));
        a list, numpy array or tensor."""
        if len(self.dst_pages) or self.state.done:
            return
        dst_pages = as_pages(dst_pages)
        n = len(dst_pages)
        if n and (dst_pages.min() <= 0 or dst_pages.max() >= self._side.num_pool_pages
                  or len(np.unique(dst_pages)) != n):
            reason = f"dst_pages: outside pool [1, {self._side.num_pool_pages}) or repeated"
            self.abort(reason)
            raise ValueError(f"room {self.room}: {reason}")
        with self.lock:
            self.dst_pages = dst_pages
            self._arrived = np.zeros(n, dtype=bool)
            self.init_at = time.monotonic()
        self._side.register(self)

    def abort(self, reason: str = "aborted by decode") -> None:
        """Fail the room, tell prefill, release the aux slot."""
        self._side.fail_room(self, reason, tell_peer=True)

    # -- manager-facing -------------------------------------------------------------------
    def check_chunk(self, header: ChunkHeader, nbytes: list[int] | None,
                    page_bytes: int, lanes: int = 1) -> str | None:
        """None if the chunk writes only this room's registered pages with matching sizes
        (payloads: the descriptors' pages for each of the `lanes` tensor-parallel ranks)."""
        err = validate_dst(header.descs, self.dst_pages, self._side.num_pool_pages)
        if err is not None:
            return err
        if nbytes is not None:
            if len(nbytes) != lanes * len(header.descs):
                return (f"{len(nbytes)} payloads for {len(header.descs)} descriptors x "
                        f"{lanes} ranks")
            for num, n in zip(header.descs[:, NUM].tolist() * lanes, nbytes):
                if n != num * page_bytes:
                    return f"size {n} bytes != {num} pages x {page_bytes} bytes"
        if header.last and header.aux is None:
            return "last chunk without aux data"
        return None

    def mark_arrived(self, header: ChunkHeader) -> bool:
        """Record a placed chunk; True when every page and the aux data are here."""
        with self.lock:
            self._arrived[run_pages(header.descs, POS)] = True
            self._num_arrived = int(np.count_nonzero(self._arrived))  # repeats count once
            if header.last and header.aux is not None:
                self._side.aux_slots.write(self.aux_slot, self.room, header.aux)
                self._have_aux = True
            self.state.touch()
            complete = self._have_aux and self._num_arrived == len(self.dst_pages)
            if complete:
                self._aux = self._side.aux_slots.read(self.aux_slot, self.room)
            return complete and self._aux is not None
