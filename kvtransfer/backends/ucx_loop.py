"""The one asyncio loop thread of a process's ucx engines, and ucxx initialised on it.

ucxx keeps one context (one UCX worker) per process, and its way of waking an awaiting
coroutine is chosen when that context is made. By default (`UCXPY_ENABLE_PYTHON_FUTURE`
unset) every awaited request polls its completion with `asyncio.sleep(0)`, so a loop with any
request outstanding (a receiver always has one) spins a core and holds the GIL: every other
thread of the process (a decode worker's scheduler, the transfer thread handing it a chunk)
then waits up to the interpreter's switch interval each time it needs the GIL. Initialised here
with Python futures, a request's completion is set on the loop by ucxx's notifier thread and
an idle engine sleeps. The notifier binds to the loop that is running when the context is
made, so the context is made from inside this loop, and every engine of the process uses it.

A completion that goes through the notifier costs a hand-over between threads (the notifier
wakes, takes the GIL, schedules a callback on the loop, which wakes from epoll). While a
transfer is under way the loop saves that: a task sets the futures of finished requests
itself (`run_request_notifier`, what the notifier schedules) on every loop iteration, from the
start of a `hot()` block until HOT_S after its end. So an idle engine sleeps and a busy one
sees a completion within one iteration of its loop, as ucxx's polling mode does.

`UCXPY_ENABLE_PYTHON_FUTURE=0` in the environment keeps ucxx's polling (for comparison).
A context made before (by another library in the process) is used as it is.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HOT_S = 0.002  # the loop polls completions this long after the last transfer activity

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_hot_until = 0.0
_busy = 0  # transfers under way on the loop
_poller: asyncio.Task | None = None


def ucx_loop() -> asyncio.AbstractEventLoop:
    """The process's ucx loop, started (and ucxx initialised on it) on first use."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="kv-ucx", daemon=True).start()
            asyncio.run_coroutine_threadsafe(_init(), loop).result(30)
            _loop = loop
        return _loop


async def _init() -> None:
    import ucxx
    from ucxx import core

    if core._ctx is not None:
        return
    env = "UCXPY_ENABLE_PYTHON_FUTURE" in os.environ
    ucxx.init(enable_python_future=None if env else True)
    ctx: Any = core._ctx
    if ctx.notifier_thread is not None:
        # the notifier is not a daemon thread: stop it before the interpreter joins threads
        threading._register_atexit(_stop_notifier)  # type: ignore[attr-defined]


@contextmanager
def hot() -> Iterator[None]:
    """A transfer's block: the loop polls completions from its start until HOT_S after its
    end (on the loop thread; in ucxx's polling mode every awaited request polls already)."""
    global _busy, _hot_until, _poller
    from ucxx import core

    ctx: Any = core._ctx
    _busy += 1
    if ctx is not None and ctx.notifier_thread is not None and (
            _poller is None or _poller.done()):
        _poller = asyncio.ensure_future(_poll(ctx.worker))
    try:
        yield
    finally:
        _busy -= 1
        _hot_until = time.monotonic() + HOT_S


async def _poll(worker: Any) -> None:
    while _busy > 0 or time.monotonic() < _hot_until:
        worker.run_request_notifier()
        await asyncio.sleep(0)


def _stop_notifier() -> None:
    from ucxx import core

    ctx: Any = core._ctx
    if ctx is None or ctx.notifier_thread is None:
        return
    ctx.worker.stop_request_notifier_thread()  # wakes its wait at once
    ctx.stop_notifier_thread()
