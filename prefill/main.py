"""`pdserve prefill`: run a prefill worker."""

from __future__ import annotations

import argparse

from pdserve.engine.engine import EngineConfig, build_engine_parts
from pdserve.kvtransfer.config import add_transfer_args, transfer_config_from_args
from pdserve.kvtransfer.fingerprint import Fingerprint
from pdserve.kvtransfer.manager import KVManager
from pdserve.prefill.scheduler import PrefillScheduler
from pdserve.prefill.server import PrefillService
from pdserve.worker.main import WorkerParts, run
from pdserve.worker.scheduler_thread import SchedulerThread


def build(args: argparse.Namespace, cfg: EngineConfig) -> WorkerParts:
    if cfg.tp_size > 1:
        raise ValueError("tp: KV transfer between tensor-parallel workers is not available in "
                         "this build; run --tp with the mixed role")
    parts = build_engine_parts(cfg)
    mc = parts.runner.model_config
    kv = KVManager("prefill", parts.memory.pool.buffer, transfer_config_from_args(args),
                   Fingerprint.from_pool_buffer(mc.name, parts.memory.pool.buffer))
    sched = PrefillScheduler(parts.runner, parts.memory, cfg.scheduler, kv_manager=kv)
    thread = SchedulerThread(sched, name="prefill-scheduler")
    service = PrefillService(thread, mc, parts.memory, mc.name, args.transfer_backend,
                             bootstrap_addr=kv.bootstrap_addr,
                             transfer_backends=kv.offered_backends)
    return WorkerParts(service, thread, [kv.close], parts)


def main(argv: list[str] | None = None) -> int:
    return run("prefill", argv, build, add_transfer_args)
