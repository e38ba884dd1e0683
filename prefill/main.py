"""`pdserve prefill`: run a prefill worker."""

from __future__ import annotations

import argparse

from pdserve.engine.engine import EngineConfig, build_engine_parts
from pdserve.kvtransfer.config import add_transfer_args, transfer_config_from_args
from pdserve.kvtransfer.manager import KVManager
from pdserve.kvtransfer.rank_pools import pool_share
from pdserve.prefill.scheduler import PrefillScheduler
from pdserve.prefill.server import PrefillService
from pdserve.worker.main import WorkerParts, run
from pdserve.worker.scheduler_thread import SchedulerThread


def build(args: argparse.Namespace, cfg: EngineConfig) -> WorkerParts:
    # Tensor parallelism: every rank's pool where rank 0, which sends the KV, maps it.
    share = pool_share(cfg.device, cfg.tp_size, shm=False)
    parts = build_engine_parts(cfg, share=share, with_tokenizer=False)
    mc = parts.runner.model_config
    try:
        kv = KVManager.for_worker("prefill", parts.memory.pool.buffer, mc.name, mc.num_kv_heads,
                                  parts.pools, share, transfer_config_from_args(args))
    except BaseException:
        parts.close()
        raise
    sched = PrefillScheduler(parts.runner, parts.memory, cfg.scheduler, kv_manager=kv)
    thread = SchedulerThread(sched, name="prefill-scheduler")
    kv.wake_on_change(thread.wake)
    service = PrefillService(thread, mc, parts.memory, mc.name, args.transfer_backend,
                             bootstrap_addr=kv.bootstrap_addr,
                             transfer_backends=kv.offered_backends)
    return WorkerParts(service, thread, [kv.close], parts)


def main(argv: list[str] | None = None) -> int:
    return run("prefill", argv, build, add_transfer_args)
