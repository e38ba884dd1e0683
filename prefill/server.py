"""The prefill worker's gRPC servicer: Prefill answers with the first token."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.engine.req import Req
from pdserve.engine.worker_service import WorkerServiceBase
from pdserve.proto import pdserve_pb2 as pb


@dataclass
class PrefillCtx:
    room: int
    loop: asyncio.AbstractEventLoop
    reply: asyncio.Future
    sender: Any = None
    pages_sent: int = 0
    error: str = ""
    t_arrival: float = 0.0
    t_bootstrap: float = 0.0
    t_ready: float = 0.0
    t_sent: float = 0.0

    def _resolve(self, value: Any) -> None:
        def setter() -> None:
            if not self.reply.done():
                self.reply.set_result(value)
        self.loop.call_soon_threadsafe(setter)

    def reply_first(self, req: Req) -> None:
        """Scheduler thread: the first token is sampled and the last KV chunk queued."""
        first = pb.TokenChunk(token_ids=[req.output_ids[-1]])
        if req.output_logprobs:
            first.logprobs.append(req.output_logprobs[-1])
        if req.output_top_logprobs:
            tids, tlps = req.output_top_logprobs[-1]
            first.top_logprobs.add(token_ids=tids, logprobs=tlps)
        ms = 1000.0
        timings = pb.StageTimings(
            bootstrap_ms=(self.t_ready - self.t_bootstrap) * ms,
            queue_ms=max(0.0, (time.perf_counter() - self.t_ready) * ms - req.prefill_s * ms),
            prefill_ms=req.prefill_s * ms)
        self._resolve(pb.PrefillResponse(
            request_id=req.rid.rpartition("@")[0], first=first, cached_tokens=req.cached_tokens,
            finish_reason=req.finish_reason or "", timings=timings))

    def on_done(self, req: Req) -> None:
        """Scheduler thread: the request left the worker (transfer ended, or it failed)."""
        if self.error:
            self._resolve(self.error)


class PrefillService(WorkerServiceBase):
    role = "prefill"

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        rid, ids, sp = await self.accept(request, context, "room: must be a non-zero 63-bit id")
        loop = asyncio.get_running_loop()
        ctx = PrefillCtx(request.room, loop, loop.create_future(), t_arrival=time.perf_counter())
        req = Req(rid, ids, sp)
        req.user = ctx
        sched = self.thread.scheduler

        def add() -> None:
            try:
                sched.add(req)
            except (ValueError, RuntimeError, OSError) as e:
                ctx.error = f"rejected: {e}"
                ctx.on_done(req)

        try:
            self.thread.submit(add)
            result = await ctx.reply
        except asyncio.CancelledError:
            self.submit_abort(rid, "prefill call cancelled")
            raise
        finally:
            self.leave(request.request_id, request.room, rid)
        if isinstance(result, str):
            await context.abort(grpc.StatusCode.ABORTED, f"room {request.room}: {result}")
        return result
