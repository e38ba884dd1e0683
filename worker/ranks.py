"""A tensor-parallel worker's ranks, from the serving side: a rank that dies takes the worker
down.

Its requests cannot continue (every forward pass needs every rank), so the worker does not
linger: it logs which rank died and how, and exits at once. The router then treats it as gone
(its streams break, health checks fail) and its KV peers fail the rooms they shared with it,
so every page comes back on the other side too (docs/reliability.md).
"""

from __future__ import annotations

import logging
import os

from pdserve.engine.engine import EngineParts

log = logging.getLogger("pdserve.worker")

EXIT_RANK_LOST = 3  # the exit status of a worker that lost a tensor-parallel rank


def exit_on_rank_loss(engine: EngineParts, role: str) -> None:
    """From now on, the death of one of `engine`'s other ranks ends this process."""

    def lost(message: str) -> None:
        log.critical("%s; the %s worker goes down", message, role)
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)

    engine.watch_ranks(lost)


def rank_pids(engine: EngineParts | None) -> str:
    """The process ids of the worker's ranks, rank 0 first (its ready line shows them)."""
    pids = [os.getpid()]
    if engine is not None and engine.ranks is not None:
        pids += [p.pid for p in engine.ranks.procs]
    return ",".join(str(p) for p in pids)
