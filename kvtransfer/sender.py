"""KVSender: the prefill side of one room.

Bootstrapping until decode registered its destination pages, WaitingForInput until the first
chunk, Transferring until decode acknowledges every page and the aux data, then Success.
Ownership: the request's source pages belong to the prefill scheduler and must stay untouched
until poll() is Success or Failed; the sender never frees them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.kvtransfer.aux import AuxData
from pdserve.kvtransfer.descriptors import as_pages, merge_runs
from pdserve.kvtransfer.engine import ChunkHeader
from pdserve.kvtransfer.lanes import Lane
from pdserve.kvtransfer.poll import KVPoll, RoomState
from pdserve.kvtransfer.trace import stamp

if TYPE_CHECKING:
    from pdserve.kvtransfer.prefill_side import PrefillSide


class KVSender:
    def __init__(self, room: int, side: PrefillSide) -> None:
        self.room = room
        self.state = RoomState(room, side.on_change)
        self._side = side
        self.peer: bytes | None = None  # decode manager identity, set at registration
        self.dst_pages = np.empty(0, dtype=np.int64)
        self.aux_slot = -1
        self._next_page = 0  # pages [0, _next_page) of the request were handed to send()
        self._seq = 0
        self.last_sent = False
        self.backend = ""  # chosen at the peer's handshake
        self.peer_info: dict[str, Any] = {}
        self.lanes: tuple[Lane, ...] = ()  # what each decode rank receives (from the handshake)
        # Held while pages are written one-sided and while failing: once Failed, no write.
        self.write_lock = threading.RLock()

    # -- scheduler-facing -----------------------------------------------------------------
    def poll(self) -> KVPoll:
        return self.state.status

    @property
    def failure_reason(self) -> str | None:
        return self.state.failure_reason

    @property
    def since(self) -> float:
        """When the room entered its current status (time.monotonic())."""
        return self.state.since

    @property
    def num_dst_pages(self) -> int:
        return len(self.dst_pages)

    def send(self, src_pages: list[int] | Any, start_page: int, last: bool,
             aux: AuxData | None = None) -> None:
        """Queue pages [start_page, start_page + len(src_pages)) of the request; non-blocking
        (cuda_ipc launches its asynchronous copies here, the other backends' transfer thread
        does the work).
        `src_pages`: a list, numpy array or tensor. The last chunk carries the aux data and must
        end at num_dst_pages."""
        stamp("send", self.room)
        src = as_pages(src_pages)
        if self.state.done:
            return  # failed meanwhile (peer abort, timeout); the scheduler sees it in poll()
        if self.state.status < KVPoll.WaitingForInput:
            raise RuntimeError(f"room {self.room}: send() before decode registered")
        if self.last_sent:
            raise RuntimeError(f"room {self.room}: send() after the last chunk")
        end = start_page + len(src)
        err = None
        if start_page != self._next_page:
            err = f"start_page: expected {self._next_page}, got {start_page}"
        elif end > self.num_dst_pages:
            err = (f"src_pages: pages [{start_page}, {end}) exceed the {self.num_dst_pages} "
                   f"pages decode registered")
        elif last and end != self.num_dst_pages:
            err = f"last: chunk ends at page {end}, request has {self.num_dst_pages}"
        elif last and aux is None:
            err = "aux: the last chunk must carry the aux data"
        elif len(src) and (src.min() <= 0 or src.max() >= self._side.num_pool_pages):
            err = f"src_pages: outside pool [1, {self._side.num_pool_pages})"
        if err is not None:
            self.abort(err)
            raise ValueError(f"room {self.room}: {err}")
        # Runs are capped near 8 MiB so a transport can pipeline (copy one while sending the
        # next) and no single message needs a huge buffer.
        descs = merge_runs(src, self.dst_pages[start_page:end], pos=start_page,
                           max_pages=max(1, (8 << 20) // self._side.page_bytes))
        header = ChunkHeader(self.room, self._seq, descs, last, aux if last else None)
        self._seq += 1
        self._next_page = end
        self.last_sent = last
        self.state.advance(KVPoll.Transferring)
        self.state.touch()
        self._side.submit(self, header)

    def abort(self, reason: str = "aborted by prefill") -> None:
        """Fail the room, tell decode, release it."""
        self._side.fail_room(self, reason, tell_peer=True)
