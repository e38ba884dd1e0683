"""A follower rank (1..N-1) of a tensor-parallel worker: its process, from start to exit.

It loads its shard and builds its KV pool and runner exactly as rank 0 does (engine/engine.py
`build_runner`), then runs the forward passes rank 0 announces, one by one, until STOP. It
makes no decision of its own: no scheduler, no allocator, no sampling. It exits when rank 0 is
gone (closed step channel, or the parent-death signal) so no rank outlives its worker.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.engine import EngineConfig, build_runner
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp.group import TPGroup, rank_device
from pdserve.engine.tp.pools import PoolShare
from pdserve.engine.tp.ranks import START_TIMEOUT_S, error_key, stage_key
from pdserve.engine.tp.step import StepKind, recv_step

log = logging.getLogger("pdserve.tp")

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (rank 0) exits, however it exits (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the closed step channel still ends the loop
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def follower_main(config: EngineConfig, rank: int, port: int, threads: int, parent_pid: int,
                  log_level: int, share: PoolShare | None = None) -> None:
    _die_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format=f"%(asctime)s tp-rank{rank} %(levelname)s "
                                                 "%(name)s: %(message)s")
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, config.tp_size, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    try:
        store.set(stage_key("connecting", rank), "1")
        group = TPGroup.connect(store, rank, config.tp_size, rank_device(config.device, rank))
        runner = build_runner(config, group, share=share,
                              sync=lambda stage, value: store.set(stage_key(stage, rank), value))
    except BaseException as e:  # rank 0 reports it as this rank's failure
        log.exception("tensor-parallel rank %d: start-up failed", rank)
        store.set(error_key(rank), f"{type(e).__name__}: {e}")
        sys.exit(1)
    try:
        code = follow(runner)
    finally:
        if share is not None:
            share.close()
    sys.exit(code)


@torch.inference_mode()
def follow(runner: ModelRunner) -> int:
    """Runs rank 0's forward passes until STOP (0) or until rank 0 is gone (1)."""
    rank = runner.tp.rank
    while True:
        try:
            step = recv_step(runner.tp)
            if step.kind == StepKind.STOP:
                return 0
            fb = step.batch.to_forward_batch(runner.pool, runner.attn_backend, runner.device)
            runner.run(fb, step.ids_on_device)
        except RuntimeError as e:  # a channel closed under us: rank 0 (or a peer) exited
            log.error("tensor-parallel rank %d: lost the group (%s); exiting", rank, e)
            return 1
