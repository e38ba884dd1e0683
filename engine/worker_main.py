"""`pdserve prefill|decode|mixed`: build the engine, the KV transfer, the gRPC server; serve.

Prints one line `worker ready role=R grpc=HOST:PORT bootstrap=HOST:PORT` once it serves.
SIGTERM/SIGINT drains: new requests are refused, in-flight ones finish (up to
--drain-timeout), the worker deregisters from its router and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys

import torch

from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import DECODE_WORKER_COLUMN_MAJOR, EngineConfig, build_engine_parts
from pdserve.engine.scheduler_thread import SchedulerThread
from pdserve.engine.worker_server import RouterLink, install_signal_handlers, start_grpc_server

log = logging.getLogger("pdserve.worker")


def parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"pdserve {role}", description=f"Run a {role} worker.")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = a free one)")
    p.add_argument("--bootstrap-port", type=int, default=0, help="KV bootstrap port (prefill)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-context-len", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--disable-cuda-graph", action="store_true", help="decode eagerly (CUDA)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens back before launching the next (CUDA)")
    p.add_argument("--router", default=None, help="router gRPC address to register with")
    p.add_argument("--registration-secret", default="",
                   help="cluster secret: presented to the router, and required (metadata "
                        "x-pdserve-secret) on every Worker RPC")
    p.add_argument("--tls-cert", default=None, help="gRPC server certificate (PEM): enables TLS")
    p.add_argument("--tls-key", default=None, help="gRPC server private key (PEM)")
    p.add_argument("--tls-ca", default=None, help="CA (PEM) to verify a TLS router with")
    p.add_argument("--transfer-backend", default="auto", help="auto|shm|tcp|ucx|cuda_ipc")
    p.add_argument("--bootstrap-timeout", type=float, default=10.0)
    p.add_argument("--waiting-timeout", type=float, default=30.0)
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--heartbeat-misses", type=int, default=5,
                   help="a KV peer silent for interval x misses fails all its rooms")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 = torch's default); `pdserve up` splits the cores")
    p.add_argument("--log-level", default="WARNING")
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        attention_backend=args.attention_backend, disable_radix_cache=args.disable_radix_cache,
        disable_cuda_graph=args.disable_cuda_graph,
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_pages,
                          mem_fraction=args.mem_fraction, max_reqs=args.max_running * 2 + 8,
                          max_context_len=args.max_context_len),
        scheduler=SchedulerConfig(max_running=args.max_running,
                                  chunked_prefill_size=args.chunked_prefill_size,
                                  overlap_schedule=not args.disable_overlap_schedule))


def transfer_config(args: argparse.Namespace):
    from pdserve.kvtransfer.config import TransferConfig

    return TransferConfig(
        backend=args.transfer_backend, bootstrap_host=args.host,
        bootstrap_port=args.bootstrap_port, bootstrap_timeout_s=args.bootstrap_timeout,
        waiting_timeout_s=args.waiting_timeout, transfer_timeout_s=args.transfer_timeout,
        heartbeat_interval_s=args.heartbeat_interval, heartbeat_misses=args.heartbeat_misses)


def _build(role: str, args: argparse.Namespace):
    """-> (service, kv_manager or None, closers)."""
    cfg = engine_config(args)
    if role == "decode":  # decode-only: its matmuls are all decode-sized
        cfg = dataclasses.replace(cfg, column_major_weights=DECODE_WORKER_COLUMN_MAJOR)
    closers = []
    kv = None
    shm = None
    if role == "decode" and args.transfer_backend in ("auto", "shm") and \
            not cfg.device.startswith("cuda"):
        # Same-host prefill workers write one-sided into a shared-memory pool.
        from pdserve.engine.loader import read_model_config
        from pdserve.engine.model_runner import num_kv_pages
        from pdserve.kvtransfer.shm_pool import alloc_shm_pool

        mc = read_model_config(cfg.model_path())
        n = num_kv_pages(mc, cfg.cache, cfg.torch_dtype, torch.device(cfg.device))
        shm = alloc_shm_pool(n, mc.num_layers, cfg.cache.page_size, mc.num_kv_heads,
                             mc.head_dim, cfg.torch_dtype)
        closers.append(shm.close)
    parts = build_engine_parts(cfg, shm.tensor if shm is not None else None)
    mc = parts.runner.model_config
    if role in ("prefill", "decode"):
        from pdserve.kvtransfer.fingerprint import Fingerprint
        from pdserve.kvtransfer.manager import KVManager

        fp = Fingerprint.from_pool_buffer(mc.name, parts.memory.pool.buffer)
        kv = KVManager(role, shm if shm is not None else parts.memory.pool.buffer,
                       transfer_config(args), fp)
        closers.insert(0, kv.close)
    if role == "prefill":
        from pdserve.prefill.scheduler import PrefillScheduler
        from pdserve.prefill.server import PrefillService

        sched = PrefillScheduler(parts.runner, parts.memory, cfg.scheduler, kv_manager=kv)
        service_cls = PrefillService
    else:
        from pdserve.decode.scheduler import DecodeScheduler
        from pdserve.decode.server import DecodeService, MixedService

        sched = DecodeScheduler(parts.runner, parts.memory, cfg.scheduler, kv_manager=kv)
        service_cls = DecodeService if role == "decode" else MixedService
    thread = SchedulerThread(sched, name=f"{role}-scheduler")
    service = service_cls(thread, mc, parts.memory, mc.name,
                          args.transfer_backend if kv is not None else "")
    if kv is not None and role == "prefill":
        service.bootstrap_addr = kv.bootstrap_addr
    return service, thread, closers


async def _serve(role: str, args: argparse.Namespace) -> int:
    service, thread, closers = _build(role, args)
    thread.start()
    server, port, health = await start_grpc_server(
        service, args.host, args.port, args.registration_secret or None, args.tls_cert,
        args.tls_key)
    service.address = f"{args.host}:{port}"
    stop = asyncio.Event()
    install_signal_handlers(stop)
    link = None
    if args.router:
        link = RouterLink(args.router, service.info, service.load, args.registration_secret,
                          args.tls_ca)
        await link.start()
    print(f"worker ready role={role} grpc={service.address} "
          f"bootstrap={service.bootstrap_addr or '-'} id={service.worker_id}", flush=True)
    try:
        await stop.wait()
    finally:
        service.draining = True
        if link is not None:
            link.draining = True
        from grpc_health.v1 import health_pb2

        from pdserve.engine.worker_server import _set_health
        await _set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
        await service.wait_idle(args.drain_timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.drain_timeout
        while thread.scheduler.has_work and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if link is not None:
            await link.deregister()
        await server.stop(grace=1.0)
        thread.stop()
        for close in closers:
            try:
                close()
            except Exception:  # shutdown continues; every resource gets its chance
                log.exception("close failed")
    return 0


def run(role: str, argv: list[str] | None) -> int:
    args = parser(role).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    try:
        return asyncio.run(_serve(role, args))
    except (ValueError, OSError) as e:
        print(f"pdserve {role}: error: {e}", file=sys.stderr)
        return 2
