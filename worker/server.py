"""The worker's gRPC server: the Worker service, grpc.health.v1, reflection; signals."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.proto.rpc import AuthInterceptor, add_port, secret_check

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
    await set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


async def set_health(h, status) -> None:
    res = h.set("", status)
    if asyncio.iscoroutine(res):
        await res
    res = h.set("pdserve.v1.Worker", status)
    if asyncio.iscoroutine(res):
        await res


def install_signal_handlers(stop: asyncio.Event, hurry: asyncio.Event | None = None) -> None:
    """SIGTERM/SIGINT/SIGHUP set `stop` (drain); another one while stopping sets `hurry`
    (stop now)."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set() and hurry is not None:
            hurry.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):
            pass
