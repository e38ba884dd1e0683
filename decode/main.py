"""`pdserve decode` and `pdserve mixed`: run a decode worker, or a worker that prefills and
decodes in one process with no transfer (the colocated baseline)."""

from __future__ import annotations

import argparse
import dataclasses

from pdserve.decode.scheduler import DecodeScheduler
from pdserve.decode.server import DecodeService, MixedService
from pdserve.engine.engine import DECODE_WORKER_COLUMN_MAJOR, EngineConfig, build_engine_parts
from pdserve.kvtransfer.config import add_transfer_args, transfer_config_from_args
from pdserve.kvtransfer.manager import KVManager
from pdserve.kvtransfer.rank_pools import pool_share
from pdserve.worker.main import WorkerParts, run
from pdserve.worker.scheduler_thread import SchedulerThread


def build_decode(args: argparse.Namespace, cfg: EngineConfig) -> WorkerParts:
    # Decode-only: its matmuls are all decode-sized.
    cfg = dataclasses.replace(cfg, column_major_weights=DECODE_WORKER_COLUMN_MAJOR)
    # Host pools in shared memory: same-host prefill workers write them one-sided.
    share = pool_share(cfg.device, cfg.tp_size, args.transfer_backend in ("auto", "shm"))
    parts = build_engine_parts(cfg, share=share, with_tokenizer=False)
    mc = parts.runner.model_config
    try:
        kv = KVManager.for_worker("decode", parts.memory.pool.buffer, mc.name, mc.num_kv_heads,
                                  parts.pools, share, transfer_config_from_args(args))
    except BaseException:
        parts.close()
        raise
    sched = DecodeScheduler(parts.runner, parts.memory, cfg.scheduler, kv_manager=kv)
    thread = SchedulerThread(sched, name="decode-scheduler")
    kv.wake_on_change(thread.wake)
    service = DecodeService(thread, mc, parts.memory, mc.name, args.transfer_backend,
                            transfer_backends=kv.offered_backends)
    return WorkerParts(service, thread, [kv.close], parts)


def build_mixed(args: argparse.Namespace, cfg: EngineConfig) -> WorkerParts:
    parts = build_engine_parts(cfg, with_tokenizer=False)
    mc = parts.runner.model_config
    sched = DecodeScheduler(parts.runner, parts.memory, cfg.scheduler)
    thread = SchedulerThread(sched, name="mixed-scheduler")
    return WorkerParts(MixedService(thread, mc, parts.memory, mc.name), thread, engine=parts)


def main(argv: list[str] | None = None) -> int:
    return run("decode", argv, build_decode, add_transfer_args)


def main_mixed(argv: list[str] | None = None) -> int:
    return run("mixed", argv, build_mixed, add_transfer_args)
