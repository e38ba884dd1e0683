"""The decode (and mixed) worker's gRPC servicer: Decode streams tokens."""

from __future__ import annotations

import grpc

from pdserve.decode.scheduler import DecodeReq
from pdserve.proto import pdserve_pb2 as pb
from pdserve.worker.events import FinishEvent, TokenOutput, TokensEvent
from pdserve.worker.service import WorkerServiceBase, chunk_of, timings_of


class DecodeService(WorkerServiceBase):
    role = "decode"

    async def Prefill(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{self.role} worker: Prefill is served by prefill workers")

    async def Decode(self, request: pb.DecodeRequest, context):
        rid, valid = await self.accept(
            request, context,
            "room: must be a non-zero 63-bit id with a bootstrap_addr"
            if request.bootstrap_addr else None)
        chan = self.channel()
        req = DecodeReq(rid, valid.input_ids, valid.sampling, room=request.room,
                        bootstrap_addr=request.bootstrap_addr, sink=chan)
        finished = False
        try:
            self.submit_add(req, chan)
            while True:
                # Everything that arrived since the last message leaves as one: a stream that
                # fell behind catches up in fewer messages, its tokens unchanged and in order.
                tokens: list[TokenOutput] = []
                for ev in await chan.get_batch():
                    if isinstance(ev, TokensEvent):
                        tokens.append(ev.tokens)
                        continue
                    finished = True
                    if isinstance(ev, FinishEvent):
                        usage = pb.Usage(prompt_tokens=ev.prompt_tokens,
                                         completion_tokens=ev.completion_tokens,
                                         cached_tokens=ev.cached_tokens)
                        yield pb.DecodeResponse(
                            request_id=request.request_id,
                            chunk=chunk_of(TokenOutput.concat([*tokens, ev.tokens])),
                            finish_reason=ev.reason, usage=usage,
                            timings=timings_of(ev.timings))
                        return
                    if tokens:
                        yield pb.DecodeResponse(request_id=request.request_id,
                                                chunk=chunk_of(TokenOutput.concat(tokens)))
                    await context.abort(grpc.StatusCode.ABORTED, ev.message)
                if tokens:
                    yield pb.DecodeResponse(request_id=request.request_id,
                                            chunk=chunk_of(TokenOutput.concat(tokens)))
        finally:
            if not finished:  # client went away or the call was cancelled
                self.submit_abort(rid, "decode stream cancelled")
            self.leave(request.request_id, request.room, rid)


class MixedService(DecodeService):
    role = "mixed"
