"""What every worker process shares: the gRPC server, health, router registration, drain.

A worker is one asyncio loop (gRPC) plus one SchedulerThread. Registration with a router is
optional (`--router`): the worker registers, heartbeats its load every interval, re-registers if
the router forgot it (router restart), and deregisters when it drains.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.grpc_auth import AuthInterceptor, add_port, open_channel, secret_check

log = logging.getLogger(__name__)


async def start_grpc_server(servicer: pb_grpc.WorkerServicer, host: str, port: int,
                            secret: str | None = None, tls_cert: str | None = None,
                            tls_key: str | None = None
                            ) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Worker + health + reflection. With `secret`, every Worker RPC needs it (metadata
    x-pdserve-secret); with a certificate and key, the port speaks TLS."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)],
                             interceptors=[AuthInterceptor(secret_check(secret))])
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else \
        health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Worker"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = add_port(server, f"{host}:{port}", tls_cert, tls_key)
    if bound == 0:
        raise OSError(f"port: cannot bind {host}:{port}")
    await server.start()
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


async def _set_health(h, status) -> None:
    res = h.set("", status)
    if asyncio.iscoroutine(res):
        await res
    res = h.set("pdserve.v1.Worker", status)
    if asyncio.iscoroutine(res):
        await res


class RouterLink:
    """Registration + heartbeat lease with a router's Router service."""

    def __init__(self, router_addr: str, info_fn: Callable[[], pb.WorkerInfo],
                 load_fn: Callable[[], pb.WorkerLoad], secret: str = "",
                 ca_file: str | None = None) -> None:
        self.router_addr = router_addr
        self.info_fn = info_fn
        self.load_fn = load_fn
        self.secret = secret
        self.worker_id = ""
        self.interval_s = 1.0
        self.draining = False
        self._channel = open_channel(router_addr, ca_file)
        self._stub = pb_grpc.RouterStub(self._channel)
        self._task: asyncio.Task | None = None

    async def _register(self) -> None:
        resp = await self._stub.RegisterWorker(
            pb.RegisterWorkerRequest(worker=self.info_fn(), secret=self.secret), timeout=5)
        self.worker_id = resp.worker_id
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        log.info("registered with router %s as %s", self.router_addr, self.worker_id)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                if not self.worker_id:
                    await self._register()
                else:
                    resp = await self._stub.Heartbeat(pb.HeartbeatRequest(
                        worker_id=self.worker_id, load=self.load_fn(), secret=self.secret,
                        draining=self.draining), timeout=5)
                    if not resp.known:
                        self.worker_id = ""
                        continue
            except grpc.aio.AioRpcError as e:  # router down or restarting: keep trying
                log.debug("router %s unreachable: %s", self.router_addr, e.code())
                self.worker_id = "" if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED else \
                    self.worker_id
            await asyncio.sleep(self.interval_s)

    async def deregister(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.worker_id:
            try:
                await self._stub.Deregister(pb.DeregisterRequest(
                    worker_id=self.worker_id, secret=self.secret), timeout=3)
            except grpc.aio.AioRpcError:
                pass
        await self._channel.close()


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
