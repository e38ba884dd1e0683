"""Runs a Scheduler on its own thread beside an asyncio gRPC server.

The server never touches scheduler state: it posts commands (callables) to the inbox, and the
scheduler thread runs them between iterations. Results travel back through callbacks that the
server side makes thread-safe (loop.call_soon_threadsafe). The thread sleeps when idle.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.engine.forward_batch import ForwardMode

log = logging.getLogger(__name__)


def _nothing() -> None:
    pass


class SchedulerThread:
    def __init__(self, scheduler: Any, idle_poll_s: float = 0.002, name: str = "scheduler"
                 ) -> None:
        self.scheduler = scheduler
        self.inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.idle_poll_s = idle_poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None
        self.snapshot: dict[str, Any] = {}

    def start(self) -> None:
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread before its next iteration."""
        self.inbox.put(fn)

    def wake(self) -> None:
        """End an idle wait now (from any thread): e.g. a KV room the scheduler polls moved."""
        self.inbox.put(_nothing)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.inbox.put(_nothing)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _drain(self, block: bool) -> None:
        try:
            fn = self.inbox.get(timeout=self.idle_poll_s) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                fn()
            except Exception:  # a bad command must not kill the loop
                log.exception("scheduler command failed")
            try:
                fn = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        sched = self.scheduler
        try:
            ran = True
            while not self._stop.is_set():
                # Block briefly when the last iteration ran nothing (idle, or only waiting on
                # peers): a spinning thread would starve the gRPC loop and transfer threads.
                self._drain(block=not (ran and sched.has_work))
                ran = False
                if sched.has_work:
                    ran = sched.step() != ForwardMode.IDLE
                elif getattr(sched, "trace", None) is not None:
                    sched.trace.flush()  # idle: the steps so far reach the file
                self.snapshot = sched.snapshot() if hasattr(sched, "snapshot") else {}
        except BaseException as e:  # surfaced through health: the worker becomes NOT_SERVING
            self.error = e
            log.exception("scheduler thread died")
        finally:
            self.snapshot = dict(self.snapshot, stopped_at=time.time())
