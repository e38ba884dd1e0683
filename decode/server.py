"""The decode (and mixed) worker's gRPC servicer: Decode streams tokens."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.engine.req import Req
from pdserve.engine.stream import ReqChannel, StreamEvent
from pdserve.engine.worker_common import (
    tokens_chunk,
)
from pdserve.engine.worker_service import WorkerServiceBase
from pdserve.proto import pdserve_pb2 as pb


@dataclass
class DecodeCtx:
    room: int
    bootstrap_addr: str
    channel: ReqChannel
    skip_first_token: bool = False
    receiver: Any = None
    t_arrival: float = 0.0
    t_prealloc: float = 0.0
    t_transferred: float = 0.0
    _skipped: bool = False
    # The finishing step's tokens travel with the finish message, so a client that stops
    # reading at its last token still gets usage and stage timings in the same message.
    _last_chunk: pb.TokenChunk | None = None

    def emit(self, event: StreamEvent) -> None:
        self.channel.put(event)

    def emit_tokens(self, req: Req, num_new: int) -> None:
        if self.skip_first_token and not self._skipped and len(req.output_ids) == num_new:
            self._skipped = True
            num_new -= 1
            if num_new == 0:
                return
        chunk = tokens_chunk(req, num_new)
        if req.finished:
            self._last_chunk = chunk
            return
        self.channel.put(StreamEvent("tokens", info={"chunk": chunk}))

    def emit_finish(self, req: Req) -> None:
        now = time.perf_counter()
        ms = 1000.0
        first = req.first_token_time or now
        start = self.t_transferred or first
        timings = pb.StageTimings(
            ttft_ms=(first - self.t_arrival) * ms,
            transfer_ms=(self.t_transferred - self.t_prealloc) * ms if self.t_transferred else 0,
            prefill_ms=req.prefill_s * ms,
            decode_ms=(now - start) * ms)
        usage = pb.Usage(prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids),
                         cached_tokens=req.cached_tokens)
        self.channel.put(StreamEvent("finish", finish_reason=req.finish_reason or "abort",
                                     info={"usage": usage, "timings": timings,
                                           "chunk": self._last_chunk}))


class DecodeService(WorkerServiceBase):
    role = "decode"

    async def Prefill(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{self.role} worker: Prefill is served by prefill workers")

    async def Decode(self, request: pb.DecodeRequest, context):
        rid, ids, sp = await self.accept(
            request, context,
            "room: must be a non-zero 63-bit id with a bootstrap_addr"
            if request.bootstrap_addr else None)
        chan = ReqChannel(asyncio.get_running_loop())
        ctx = DecodeCtx(request.room, request.bootstrap_addr, chan, request.skip_first_token,
                        t_arrival=time.perf_counter())
        req = Req(rid, ids, sp)
        req.user = ctx
        sched = self.thread.scheduler

        def add() -> None:
            try:
                sched.add(req)
            except (ValueError, RuntimeError, OSError) as e:
                chan.put(StreamEvent("error", message=f"rejected: {e}"))

        finished = False
        try:
            self.thread.submit(add)
            while True:
                ev = await chan.get()
                if ev.kind == "tokens":
                    yield pb.DecodeResponse(request_id=request.request_id, chunk=ev.info["chunk"])
                elif ev.kind == "finish":
                    finished = True
                    yield pb.DecodeResponse(request_id=request.request_id,
                                            chunk=ev.info["chunk"],
                                            finish_reason=ev.finish_reason,
                                            usage=ev.info["usage"], timings=ev.info["timings"])
                    return
                else:
                    finished = True
                    await context.abort(grpc.StatusCode.ABORTED, ev.message)
        finally:
            if not finished:  # client went away or the call was cancelled
                self.submit_abort(rid, "decode stream cancelled")
            self.leave(request.request_id, request.room, rid)


class MixedService(DecodeService):
    role = "mixed"
