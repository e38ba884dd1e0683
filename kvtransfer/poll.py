"""KVPoll and the per-room state machine: monotonic, Failed overrides, thread-safe."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import IntEnum


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class RoomState:
    """One room's status. Reads are a plain attribute load (cheap, called every scheduler step);
    writes take the lock so that a terminal state is entered exactly once."""

    def __init__(self, room: int, on_change: Callable[[], None] | None = None) -> None:
        self.room = room
        # Called (on the thread that moved the room) after every change of status: the
        # scheduler that polls rooms wakes at once instead of at its next idle poll.
        self._on_change = on_change
        self._lock = threading.Lock()
        self._status = KVPoll.Bootstrapping
        self.failure_reason: str | None = None
        self.since = time.monotonic()  # when the current status was entered
        self.progress = self.since  # last sign of progress (a chunk sent or received)

    @property
    def status(self) -> KVPoll:
        return self._status

    @property
    def done(self) -> bool:
        return self._status in (KVPoll.Success, KVPoll.Failed)

    def advance(self, to: KVPoll) -> bool:
        """Move forward to `to` (never back, never out of a terminal state). True if moved."""
        with self._lock:
            if self._status in (KVPoll.Success, KVPoll.Failed) or to <= self._status:
                return False
            if to == KVPoll.Failed:
                return False  # use fail()
            self._status = to
            self.since = self.progress = time.monotonic()
        if self._on_change is not None:
            self._on_change()
        return True

    def touch(self) -> None:
        self.progress = time.monotonic()

    def fail(self, reason: str) -> bool:
        """Enter Failed unless already terminal. True if this call failed the room."""
        with self._lock:
            if self._status in (KVPoll.Success, KVPoll.Failed):
                return False
            self._status = KVPoll.Failed
            self.failure_reason = reason
            self.since = time.monotonic()
        if self._on_change is not None:
            self._on_change()
        return True
