"""A tensor-parallel worker's ranks, from the serving side: a rank that dies takes the worker
down.

Its requests cannot continue (every forward pass needs every rank), so the worker does not
linger: it logs which rank died and how and stops at once, as on a second SIGTERM (in-flight
RPCs cancelled, KV transfers failed, shared memory released, the other ranks stopped), exiting
with EXIT_RANK_LOST; if that stop itself hangs (a collective waiting for the dead rank), the
process exits anyway after a grace period. The router then treats it as gone (its streams
break, health checks fail) and its KV peers fail the rooms they shared with it, so every page
comes back on the other side too (docs/reliability.md).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from pdserve.engine.engine import EngineParts

log = logging.getLogger("pdserve.worker")

EXIT_RANK_LOST = 3  # the exit status of a worker that lost a tensor-parallel rank


def exit_on_rank_loss(engine: EngineParts, role: str, stop_now: Callable[[], None],
                      grace_s: float = 10.0) -> None:
    """From now on, the death of one of `engine`'s other ranks stops this worker: `stop_now()`
    (thread-safe) starts its immediate shutdown; the process exits within `grace_s` however
    that goes."""

    def lost(message: str) -> None:
        log.critical("%s; the %s worker goes down", message, role)
        stop_now()
        timer = threading.Timer(grace_s, lambda: os._exit(EXIT_RANK_LOST))
        timer.daemon = True
        timer.start()

    engine.watch_ranks(lost)


def rank_pids(engine: EngineParts | None) -> str:
    """The process ids of the worker's ranks, rank 0 first (its ready line shows them)."""
    pids = [os.getpid()]
    if engine is not None and engine.ranks is not None:
        pids += [p.pid for p in engine.ranks.procs]
    return ",".join(str(p) for p in pids)
