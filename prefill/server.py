"""The prefill worker's gRPC servicer: Prefill answers once the prompt is in KV.

The first token, its logprob and its top alternatives travel to decode in the aux data of the
last KV chunk (prefill/scheduler.py) and in the answer, sent just before that chunk, with the
cached-token count and timings: the router streams the token while the KV is on its way.
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.prefill.scheduler import PrefillReq
from pdserve.proto import pdserve_pb2 as pb
from pdserve.worker.events import ErrorEvent
from pdserve.worker.service import WorkerServiceBase, chunk_of, timings_of


class PrefillService(WorkerServiceBase):
    role = "prefill"

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        rid, valid = await self.accept(request, context, "room: must be a non-zero 63-bit id")
        chan = self.channel()
        req = PrefillReq(rid, valid.input_ids, valid.sampling, room=request.room, sink=chan)
        try:
            self.submit_add(req, chan)
            event = await chan.get()
        except asyncio.CancelledError:
            self.submit_abort(rid, "prefill call cancelled")
            raise
        finally:
            self.leave(request.request_id, request.room, rid)
        if isinstance(event, ErrorEvent):
            await context.abort(grpc.StatusCode.ABORTED, f"room {request.room}: {event.message}")
        return pb.PrefillResponse(request_id=request.request_id,
                                  cached_tokens=event.cached_tokens,
                                  finish_reason=event.finish_reason,
                                  timings=timings_of(event.timings),
                                  first_token=chunk_of(event.first))
