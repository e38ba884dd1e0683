"""The other ranks of a tensor-parallel worker, as rank 0 (the calling process) sees them.

Start: rank 0 hosts a TCPStore on a free loopback port (all ranks of a worker share one host:
one pod) and spawns ranks 1..N-1 as `spawn` processes (engine/tp/follower.py). They meet in the
store, join the process groups, load their shards and report each stage there; rank 0 polls
those keys and the processes, so a rank that fails while starting fails the worker at once
with that rank's error, and the worker reports ready only once every rank is (ranks start
together).

Serving: a watcher thread waits on the rank processes. One that exits while the worker runs is
reported once through `on_lost`, after the other ranks were stopped (a worker logs it and exits,
and the router's fault paths take over). A rank notices rank 0's exit by its closed step
channel, or by the parent-death signal Linux sends it.

Stop: rank 0 sends STOP on the step channel; the ranks leave their loops and exit; any still
there after a grace period is killed.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pdserve.engine.tp.group import TPGroup, rank_device
from pdserve.engine.tp.step import send_stop

if TYPE_CHECKING:
    from pdserve.engine.engine import EngineConfig
    from pdserve.engine.tp.pools import PoolShare

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # loading a large model's shard (and capturing graphs) takes a while
_POLL_S = 0.05


class RankError(RuntimeError):
    """A tensor-parallel rank failed to start, or died."""


def stage_key(stage: str, rank: int) -> str:
    return f"stage/{stage}/{rank}"


def error_key(rank: int) -> str:
    return f"error/{rank}"


class RankSet:
    """Ranks 1..size-1 of the worker whose rank 0 builds this."""

    def __init__(self, config: EngineConfig, share: PoolShare | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        from pdserve.engine.tp.follower import follower_main

        self.size = config.tp_size
        self.device = rank_device(config.device, 0)
        self.start_timeout_s = start_timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True,
                                   timeout=timedelta(seconds=start_timeout_s),
                                   wait_for_workers=False)
        threads = torch.get_num_threads()
        if self.device.type == "cpu":
            # The ranks share the host's cores: oversubscribed threads slow every matmul.
            threads = max(1, threads // self.size)
            torch.set_num_threads(threads)
        ctx = multiprocessing.get_context("spawn")
        self.procs = [
            ctx.Process(target=follower_main, name=f"pdserve-tp-rank{r}", daemon=True,
                        args=(config, r, self.store.port, threads, os.getpid(),
                              logging.getLogger().getEffectiveLevel(), share))
            for r in range(1, self.size)]
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        for p in self.procs:
            p.start()

    # ---- start-up ---------------------------------------------------------------------------

    def wait(self, stage: str) -> None:
        """Until every rank reached `stage`; RankError naming the rank that failed first."""
        deadline = time.monotonic() + self.start_timeout_s
        pending = set(range(1, self.size))
        while pending:
            for r in sorted(pending):
                if self.store.check([stage_key(stage, r)]):
                    pending.discard(r)
                elif not self.procs[r - 1].is_alive():
                    raise RankError(f"tensor-parallel rank {r} of {self.size} failed while "
                                    f"{stage}: {self._why(r)}")
            if pending and time.monotonic() > deadline:
                raise RankError(f"tensor-parallel rank(s) {sorted(pending)} did not finish "
                                f"{stage} within {self.start_timeout_s:.0f} s")
            if pending:
                time.sleep(_POLL_S)

    def value(self, stage: str, rank: int) -> str:
        """What rank `rank` reported with `stage` (after wait(stage))."""
        return self.store.get(stage_key(stage, rank)).decode()

    def _why(self, rank: int) -> str:
        if self.store.check([error_key(rank)]):
            return self.store.get(error_key(rank)).decode(errors="replace")
        return f"exited with code {self.procs[rank - 1].exitcode}"

    def connect(self) -> TPGroup:
        """Rank 0 joins the group, once every rank is about to."""
        self.wait("connecting")
        return TPGroup.connect(self.store, 0, self.size, self.device)

    # ---- serving ----------------------------------------------------------------------------

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """From now on, a rank that exits (other than by close) is reported by `on_lost`."""
        self._watcher = threading.Thread(target=self._watch, args=(on_lost,), daemon=True,
                                         name="tp-rank-watcher")
        self._watcher.start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
        while not self._closing.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            if not ready or self._closing.is_set():
                continue
            r = sentinels[ready[0]]
            p = self.procs[r - 1]
            p.join(1.0)
            message = (f"tensor-parallel rank {r} of {self.size} (pid {p.pid}) exited with "
                       f"code {p.exitcode}")
            self._kill()
            on_lost(message)
            return

    # ---- stop -------------------------------------------------------------------------------

    def close(self, group: TPGroup | None, timeout_s: float = 10.0) -> None:
        """Stops every rank: STOP on the step channel (when `group` is live), then a kill."""
        if self._closing.is_set():
            return
        self._closing.set()
        if group is not None and group.cpu is not None and all(p.is_alive() for p in self.procs):
            try:
                send_stop(group)
            except RuntimeError:
                log.warning("tensor-parallel ranks: STOP not delivered; killing them")
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5.0)
