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

`UCXPY_ENABLE_PYTHON_FUTURE=0` in the environment keeps ucxx's polling (for comparison).
A context made before (by another library in the process) is used as it is.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


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


def _stop_notifier() -> None:
    from ucxx import core

    ctx: Any = core._ctx
    if ctx is None or ctx.notifier_thread is None:
        return
    ctx.worker.stop_request_notifier_thread()  # wakes its wait at once
    ctx.stop_notifier_thread()
