"""The worker process all roles share: flags, the gRPC server, router registration, drain.

A role (prefill/main.py, decode/main.py) adds its own flags and supplies `build`, which makes
its engine, scheduler thread and servicer; `run` does the rest. The process prints one line
`worker ready role=R grpc=HOST:PORT bootstrap=HOST:PORT ... tp=N pids=P0,P1,..` once it
serves (with --tp N, once all N ranks are; rank 0 is this process). SIGTERM, SIGINT and
SIGHUP drain: new requests are refused, in-flight ones finish (up to --drain-timeout), the
worker deregisters from its router and exits 0. A second signal during the drain stops at once:
in-flight requests are aborted (their RPCs cancelled, their KV pages and shared memory released
as on any stop).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from grpc_health.v1 import health_pb2

from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, EngineParts
from pdserve.engine.model_shapes import add_model_source_args
from pdserve.engine.tp.ranks import RankError
from pdserve.engine.warmup import warm_up
from pdserve.pauses import SWITCH_INTERVAL_MS, set_switch_interval, settle_heap
from pdserve.proto.rpc import run_event_loop
from pdserve.worker.ranks import EXIT_RANK_LOST, exit_on_rank_loss, rank_pids
from pdserve.worker.router_link import RouterLink
from pdserve.worker.scheduler_thread import SchedulerThread
from pdserve.worker.server import install_signal_handlers, set_health, start_grpc_server
from pdserve.worker.service import WorkerServiceBase
from pdserve.worker.sm_share import apply_sm_share

log = logging.getLogger("pdserve.worker")


@dataclass
class WorkerParts:
    """What a role's `build` returns: the servicer, its scheduler thread, what to close (in
    order) once the worker stopped, and its engine (whose tensor-parallel ranks stop last)."""

    service: WorkerServiceBase
    thread: SchedulerThread
    closers: list[Callable[[], None]] = field(default_factory=list)
    engine: EngineParts | None = None


Build = Callable[[argparse.Namespace, EngineConfig], WorkerParts]


def parser(role: str, add_role_args: Callable[[argparse.ArgumentParser], None] | None = None
           ) -> argparse.ArgumentParser:
    cache, sched, eng = CacheConfig, SchedulerConfig, EngineConfig
    p = argparse.ArgumentParser(prog=f"pdserve {role}", description=f"Run a {role} worker.")
    p.add_argument("--model", default=eng.model, help="HF directory or .gguf (default: SmolLM2)")
    add_model_source_args(p)
    p.add_argument("--device", default=eng.device,
                   help="auto (cuda when a GPU is there, else cpu), cpu or cuda[:N]")
    p.add_argument("--dtype", default=eng.dtype)
    p.add_argument("--tp", type=int, default=eng.tp_size,
                   help="tensor-parallel ranks: processes of this worker, one GPU each from "
                        "--device on (on CPU they share the worker's threads)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = a free one)")
    p.add_argument("--page-size", type=int, default=cache.page_size)
    p.add_argument("--num-pages", type=int, default=cache.num_pages)
    p.add_argument("--mem-fraction", type=float, default=cache.mem_fraction)
    p.add_argument("--max-running", type=int, default=sched.max_running)
    p.add_argument("--max-context-len", type=int, default=cache.max_context_len,
                   help="default: the model's, and never more than the KV pool holds")
    p.add_argument("--chunked-prefill-size", type=int, default=sched.chunked_prefill_size)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--attention-backend", default=eng.attention_backend)
    p.add_argument("--disable-cuda-graph", action="store_true", help="decode eagerly (CUDA)")
    p.add_argument("--stream-interval", type=int, default=sched.stream_interval,
                   help="send a running request's tokens every N of them (decode, mixed)")
    p.add_argument("--stream-messages-per-step", type=int,
                   default=sched.stream_messages_per_step,
                   help="with more requests running, send each one's tokens every "
                        "ceil(running / N) steps (decode, mixed)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens back before launching the next (CUDA)")
    p.add_argument("--router", default=None, help="router gRPC address to register with")
    p.add_argument("--registration-secret", default="",
                   help="cluster secret: presented to the router, and required (metadata "
                        "x-pdserve-secret) on every Worker RPC")
    p.add_argument("--tls-cert", default=None, help="gRPC server certificate (PEM): enables TLS")
    p.add_argument("--tls-key", default=None, help="gRPC server private key (PEM)")
    p.add_argument("--tls-ca", default=None, help="CA (PEM) to verify a TLS router with")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--skip-warmup", action="store_true",
                   help="serve at once: the first requests then pay one-time costs (weight "
                        "packing, kernel JIT) in their latency")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 = torch's default); `pdserve up` splits the cores")
    p.add_argument("--sm-share", type=float, default=1.0, metavar="F",
                   help="CUDA: use at most this share of the GPU's SMs, under an MPS control "
                        "daemon (worker/sm_share.py; `pdserve up --spatial` starts one)")
    p.add_argument("--switch-interval-ms", type=float, default=SWITCH_INTERVAL_MS, metavar="MS",
                   help="the GIL's switch interval: how long the scheduler thread may wait "
                        "for the event loop's thread to let go of it (pdserve/pauses.py; "
                        "Python's default is 5)")
    p.add_argument("--log-level", default="WARNING")
    if add_role_args is not None:
        add_role_args(p)
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, model_shape=args.model_shape, load_format=args.load_format,
        device=args.device, dtype=args.dtype,
        attention_backend=args.attention_backend, disable_radix_cache=args.disable_radix_cache,
        disable_cuda_graph=args.disable_cuda_graph, tp_size=args.tp,
        # Request slots: running requests plus those still in transfer or in the queues.
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_pages,
                          mem_fraction=args.mem_fraction, max_reqs=args.max_running * 2 + 8,
                          max_context_len=args.max_context_len),
        scheduler=SchedulerConfig(max_running=args.max_running,
                                  chunked_prefill_size=args.chunked_prefill_size,
                                  overlap_schedule=not args.disable_overlap_schedule,
                                  stream_interval=args.stream_interval,
                                  stream_messages_per_step=args.stream_messages_per_step))


async def _serve(role: str, args: argparse.Namespace, build: Build) -> int:
    parts = build(args, engine_config(args))
    service, thread = parts.service, parts.thread
    stop, hurry = asyncio.Event(), asyncio.Event()
    if parts.engine is not None:
        loop = asyncio.get_running_loop()
        exit_on_rank_loss(parts.engine, role, lambda: loop.call_soon_threadsafe(
            lambda: (hurry.set(), stop.set())))
    if not args.skip_warmup:  # before the scheduler thread owns the engine, and registration
        service.warmup_s = warm_up(thread.scheduler, log=log.info)
    settle_heap()  # start-up's objects out of every later collection
    thread.start()
    server, port, health = await start_grpc_server(
        service, args.host, args.port, args.registration_secret or None, args.tls_cert,
        args.tls_key)
    service.address = f"{args.host}:{port}"
    install_signal_handlers(stop, hurry)
    link = None
    if args.router:
        link = RouterLink(args.router, service.info, service.load, args.registration_secret,
                          args.tls_ca)
        await link.start()
    print(f"worker ready role={role} grpc={service.address} "
          f"bootstrap={service.bootstrap_addr or '-'} id={service.worker_id} tp={args.tp} "
          f"pids={rank_pids(parts.engine)} warmup_s={sum(service.warmup_s.values()):.2f}",
          flush=True)
    try:
        await stop.wait()
    finally:
        service.draining = True
        if link is not None:
            link.draining = True
        await set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
        await _unless(hurry, service.wait_idle(args.drain_timeout))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.drain_timeout
        while thread.scheduler.has_work and loop.time() < deadline and not hurry.is_set():
            await asyncio.sleep(0.05)
        if link is not None:
            await link.deregister()
        await server.stop(grace=None if hurry.is_set() else 1.0)
        thread.stop()
        closers = [*parts.closers, *([parts.engine.close] if parts.engine else [])]
        for close in closers:
            try:
                close()
            except Exception:  # shutdown continues; every resource gets its chance
                log.exception("close failed")
    lost = parts.engine is not None and parts.engine.runner.lost_rank is not None
    return EXIT_RANK_LOST if lost else 0


async def _unless(hurry: asyncio.Event, work: Awaitable[object]) -> None:
    """Await `work` unless `hurry` is set first (then it is cancelled)."""
    task = asyncio.ensure_future(work)
    hurried = asyncio.ensure_future(hurry.wait())
    await asyncio.wait({task, hurried}, return_when=asyncio.FIRST_COMPLETED)
    task.cancel()
    hurried.cancel()


def run(role: str, argv: list[str] | None, build: Build,
        add_role_args: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    args = parser(role, add_role_args).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    try:
        set_switch_interval(args.switch_interval_ms)
    except ValueError as e:
        print(f"pdserve {role}: error: {e}", file=sys.stderr)
        return 2
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    try:
        # Before any CUDA context exists: MPS reads the share when the context is made.
        warning = apply_sm_share(args.sm_share, args.device)
        if warning:
            print(f"pdserve {role}: warning: {warning}", file=sys.stderr, flush=True)
        return run_event_loop(_serve(role, args, build))
    except (ValueError, OSError, RankError) as e:
        print(f"pdserve {role}: error: {e}", file=sys.stderr)
        return 2
