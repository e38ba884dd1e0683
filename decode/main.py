"""`pdserve decode` and `pdserve mixed`: run a decode worker, or a worker that prefills and
decodes in one process with no transfer (the colocated baseline)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from pdserve.decode.scheduler import DecodeScheduler
from pdserve.decode.server import DecodeService, MixedService
from pdserve.engine.engine import DECODE_WORKER_COLUMN_MAJOR, EngineConfig, build_engine_parts
from pdserve.kvtransfer.config import add_transfer_args, transfer_config_from_args
from pdserve.kvtransfer.fingerprint import Fingerprint
from pdserve.kvtransfer.manager import KVManager
from pdserve.worker.main import WorkerParts, run
from pdserve.worker.scheduler_thread import SchedulerThread


def _shm_pool(cfg: EngineConfig):
    """Same-host prefill workers write one-sided into a shared-memory pool (CPU pools)."""
    from pdserve.engine.loader import read_model_config
    from pdserve.engine.model_runner import num_kv_pages
    from pdserve.kvtransfer.shm_pool import alloc_shm_pool

    mc = read_model_config(cfg.model_path())
    n = num_kv_pages(mc, cfg.cache, cfg.torch_dtype, torch.device(cfg.device))
    return alloc_shm_pool(n, mc.num_layers, cfg.cache.page_size, mc.num_kv_heads, mc.head_dim,
                          cfg.torch_dtype)


def build_decode(args: argparse.Namespace, cfg: EngineConfig) -> WorkerParts:
    if cfg.tp_size > 1:
        raise ValueError("tp: KV transfer between tensor-parallel workers is not available in "
                         "this build; run --tp with the mixed role")
    # Decode-only: its matmuls are all decode-sized.
    cfg = dataclasses.replace(cfg, column_major_weights=DECODE_WORKER_COLUMN_MAJOR)
    use_shm = args.transfer_backend in ("auto", "shm") and not cfg.device.startswith("cuda")
    shm = _shm_pool(cfg) if use_shm else None
    closers: list[Callable[[], None]] = [shm.close] if shm is not None else []
    try:
        parts = build_engine_parts(cfg, shm.tensor if shm is not None else None)
        mc = parts.runner.model_config
        kv = KVManager("decode", shm if shm is not None else parts.memory.pool.buffer,
                       transfer_config_from_args(args),
                       Fingerprint.from_pool_buffer(mc.name, parts.memory.pool.buffer))
    except BaseException:
        for close in closers:
            close()
        raise
    sched = DecodeScheduler(parts.runner, parts.memory, cfg.scheduler, kv_manager=kv)
    thread = SchedulerThread(sched, name="decode-scheduler")
    service = DecodeService(thread, mc, parts.memory, mc.name, args.transfer_backend,
                            transfer_backends=kv.offered_backends)
    return WorkerParts(service, thread, [kv.close, *closers], parts)


def build_mixed(args: argparse.Namespace, cfg: EngineConfig) -> WorkerParts:
    parts = build_engine_parts(cfg)
    mc = parts.runner.model_config
    sched = DecodeScheduler(parts.runner, parts.memory, cfg.scheduler)
    thread = SchedulerThread(sched, name="mixed-scheduler")
    return WorkerParts(MixedService(thread, mc, parts.memory, mc.name), thread, engine=parts)


def main(argv: list[str] | None = None) -> int:
    return run("decode", argv, build_decode, add_transfer_args)


def main_mixed(argv: list[str] | None = None) -> int:
    return run("mixed", argv, build_mixed, add_transfer_args)
