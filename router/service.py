"""The Router gRPC service (grpc.aio): Generate, Abort, worker listing and registration."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.proto.rpc import AuthInterceptor, add_port, api_key_check, sampling_dict_from_proto
from pdserve.router.core import RouterCore
from pdserve.router.errors import InvalidRequest, RouterError

log = logging.getLogger(__name__)


class RouterService(pb_grpc.RouterServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        core = self.core
        try:
            if request.text and request.input_ids:
                raise InvalidRequest("text: give text or input_ids, not both", param="text")
            if request.text:
                ids = core.preparer.encode_text(request.text, param="text")
            else:
                ids = list(request.input_ids)
            sampling = sampling_dict_from_proto(request.sampling)
            max_tokens = sampling.pop("max_tokens", 16)
            prepared = core.preparer.build(ids, sampling, max_tokens,
                                           request_id=request.request_id or None,
                                           prompt_param="input_ids" if not request.text
                                           else "text")
            final: pb.GenerateResponse | None = None
            async with contextlib.aclosing(core.flow.run(prepared)) as events:
                async for event in events:
                    if event.error is not None:
                        raise _StreamError(event.error)
                    msg = event.to_proto()
                    if request.stream:
                        yield msg
                    elif final is None:
                        final = msg
                    else:
                        final.chunk.token_ids.extend(msg.chunk.token_ids)
                        final.chunk.logprobs.extend(msg.chunk.logprobs)
                        final.chunk.top_logprobs.extend(msg.chunk.top_logprobs)
                        final.text += msg.text
                        final.finish_reason = msg.finish_reason
                        final.usage.CopyFrom(msg.usage)
                        final.timings.CopyFrom(msg.timings)
            if final is not None:
                yield final
            core.metrics.on_request("grpc_generate", "OK")
        except RouterError as e:
            core.metrics.on_request("grpc_generate", e.grpc_code.name)
            await context.abort(e.grpc_code, e.message)
        except _StreamError as e:
            core.metrics.on_request("grpc_generate", "UNAVAILABLE")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.core.flow.abort(request.request_id))

    async def ListWorkers(self, request: pb.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(workers=[w.to_proto() for w in self.core.registry.all()])

    async def _check_secret(self, secret: str, context: grpc.aio.ServicerContext) -> None:
        if not self.core.registry.check_secret(secret):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "secret: wrong registration secret")

    async def RegisterWorker(self, request: pb.RegisterWorkerRequest,
                             context: grpc.aio.ServicerContext) -> pb.RegisterWorkerResponse:
        await self._check_secret(request.secret, context)
        try:
            entry = self.core.registry.register(request.worker)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        cfg = self.core.config
        return pb.RegisterWorkerResponse(worker_id=entry.worker_id,
                                         heartbeat_interval_s=cfg.heartbeat_interval_s,
                                         lease_s=cfg.lease_s)

    async def Heartbeat(self, request: pb.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        await self._check_secret(request.secret, context)
        load = request.load if request.HasField("load") else None
        known = self.core.registry.heartbeat(request.worker_id, load, request.draining)
        return pb.HeartbeatResponse(known=known)

    async def Deregister(self, request: pb.DeregisterRequest,
                         context: grpc.aio.ServicerContext) -> pb.DeregisterResponse:
        await self._check_secret(request.secret, context)
        self.core.registry.deregister(request.worker_id)
        return pb.DeregisterResponse()


class _StreamError(Exception):
    """The workers failed after output had been produced."""


async def start_grpc_server(core: RouterCore, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the Router service + grpc.health.v1 + reflection; return (server, bound port).

    Generate/Abort/ListWorkers need the API key when one is set; TLS when a certificate is."""
    cfg = core.config
    client_methods = tuple(f"/pdserve.v1.Router/{m}" for m in ("Generate", "Abort", "ListWorkers"))
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(api_key_check(cfg.api_key, client_methods))])
    pb_grpc.add_RouterServicer_to_server(RouterService(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Router"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = add_port(server, f"{host}:{port}", cfg.tls_cert_file, cfg.tls_key_file)
    if bound == 0:
        raise OSError(f"grpc_port: cannot bind {host}:{port}")
    await server.start()
    for name in ("", names[0]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
