"""Worker.Session: many Prefill/Decode calls over one stream from a router.

A gRPC call costs both processes far more than the messages it carries (call set-up, a server
task, HTTP/2 stream state): at a wave of 256 arriving requests that set-up, not the engine, paced
how fast the batch refilled. A session carries each call as a `SessionCall` and its answers as
`SessionEvent`s, and runs the servicer's own `Prefill` / `Decode` for it with a context whose
`abort` ends that call alone, so the answers, errors and cleanup of a call are those of the RPC
of the same name. Whatever events are ready leave as one `SessionEvents` message.

A cancelled call (`cancel`, or the session ending: the router went away) is cancelled as a
cancelled RPC is: its handler's cleanup aborts the request on the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.engine import req_trace
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.rpc import split_batch

log = logging.getLogger(__name__)

MAX_EVENTS_BYTES = 1 << 20  # per SessionEvents message (the router's channel takes 4 MiB)


class CallAborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class CallContext:
    """What a Prefill/Decode handler uses of its ServicerContext, for one call of a session."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise CallAborted(code, details)


class Outbox:
    """Events waiting for the session's writer; `take` returns them in batches."""

    def __init__(self) -> None:
        self._items: list[pb.SessionEvent] = []
        self._waiter: asyncio.Future | None = None
        self.closed = False

    def put(self, event: pb.SessionEvent) -> None:
        self._items.append(event)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[pb.SessionEvent] | None:
        """The next batch (at most MAX_EVENTS_BYTES, at least one event); None once closed and
        empty."""
        while not self._items:
            if self.closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch, self._items = split_batch(self._items, MAX_EVENTS_BYTES)
        return batch


def _end(call_id: int, code: grpc.StatusCode = grpc.StatusCode.OK,
         details: str = "") -> pb.SessionEvent:
    return pb.SessionEvent(call_id=call_id, end=True, code=code.value[0], details=details)


async def _run_call(servicer, call: pb.SessionCall, out: Outbox) -> None:
    cid = call.call_id
    ctx = CallContext()
    try:
        if call.HasField("decode"):
            async for resp in servicer.Decode(call.decode, ctx):
                out.put(pb.SessionEvent(call_id=cid, decode=resp))
        elif call.HasField("prefill"):
            resp = await servicer.Prefill(call.prefill, ctx)
            out.put(pb.SessionEvent(call_id=cid, prefill=resp))
        else:
            raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                              "session call: needs a prefill or a decode request")
        out.put(_end(cid))
    except CallAborted as e:
        out.put(_end(cid, e.code, e.details))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a handler bug ends its call, not the session
        log.exception("session call %d failed", cid)
        out.put(_end(cid, grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"))


async def serve_session(servicer, requests: AsyncIterator[pb.SessionCalls]
                        ) -> AsyncIterator[pb.SessionEvents]:
    """The Session RPC's answer stream for `servicer` (which has Prefill and Decode)."""
    out = Outbox()
    calls: dict[int, asyncio.Task] = {}

    def start(call: pb.SessionCall) -> None:
        if call.call_id in calls:
            out.put(_end(call.call_id, grpc.StatusCode.ALREADY_EXISTS,
                         f"session call {call.call_id} is already running"))
            return
        task = asyncio.ensure_future(_run_call(servicer, call, out))
        calls[call.call_id] = task
        task.add_done_callback(lambda _t, cid=call.call_id: calls.pop(cid, None))

    async def read() -> None:
        try:
            async for batch in requests:
                for call in batch.calls:
                    if call.HasField("cancel"):
                        task = calls.get(call.call_id)
                        if task is not None:
                            task.cancel()
                    else:
                        start(call)
            # The router finished writing: answer what runs, then end the stream.
            while calls:
                await asyncio.wait(set(calls.values()))
        finally:
            out.close()

    reader = asyncio.ensure_future(read())
    try:
        while (batch := await out.take()) is not None:
            if req_trace.enabled():
                for event in batch:
                    if event.HasField("decode"):
                        req_trace.stamp("sent", event.decode.request_id)
                    elif event.HasField("prefill"):
                        req_trace.stamp("answered", event.prefill.request_id)
            yield pb.SessionEvents(events=batch)
    finally:
        reader.cancel()
        for task in list(calls.values()):
            task.cancel()
        pending = [reader, *calls.values()]
        await asyncio.gather(*pending, return_exceptions=True)
