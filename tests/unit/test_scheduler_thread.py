"""SchedulerThread: commands run between iterations, and `wake()` ends an idle wait."""

from __future__ import annotations

import threading
import time

from pdserve.engine.forward_batch import ForwardMode
from pdserve.worker.scheduler_thread import SchedulerThread


class _WaitsOnPeer:
    """has_work (a room it polls) but nothing to run until `ready` is set by another thread."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.ran_at = 0.0

    @property
    def has_work(self) -> bool:
        return not self.ran_at

    def step(self) -> ForwardMode:
        if self.ready.is_set():
            self.ran_at = time.monotonic()
            return ForwardMode.DECODE
        return ForwardMode.IDLE


def test_wake_ends_the_idle_wait_at_once() -> None:
    sched = _WaitsOnPeer()
    thread = SchedulerThread(sched, idle_poll_s=30.0)
    thread.start()
    try:
        time.sleep(0.05)  # the thread is now in its idle wait
        sched.ready.set()
        t0 = time.monotonic()
        thread.wake()
        deadline = t0 + 10.0
        while not sched.ran_at and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sched.ran_at, "the woken thread did not step"
        assert sched.ran_at - t0 < 10.0 < thread.idle_poll_s  # not the poll that ended it
    finally:
        thread.stop()
    assert not thread.alive
