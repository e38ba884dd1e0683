"""The router's side of Worker.Session: Prefill and Decode calls multiplexed on one stream.

One long-lived bidirectional stream per worker carries every call the router makes to it
(worker/session.py serves it). A call is a few hundred bytes in a batch instead of a gRPC call's
set-up on both sides, which at a wave of arriving requests was what the router's loop and the
worker's spent their time on. `SessionCall` behaves as the grpc.aio call it replaces: `read()`
returns the answers then `grpc.aio.EOF`, raises `grpc.aio.AioRpcError` with the worker's status
when the call failed (or DEADLINE_EXCEEDED at its timeout), and `asyncio.CancelledError` after
`cancel()`, which tells the worker to cancel the call.

When the stream breaks (the worker died, its channel closed), every open call fails with
UNAVAILABLE and the next call opens a new session.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Coroutine
from typing import Any

import grpc

from pdserve.engine import req_trace
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.proto.rpc import split_batch

log = logging.getLogger(__name__)

MAX_CALLS_BYTES = 4 << 20  # per SessionCalls message (the worker accepts 64 MiB)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _status(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN


class SessionCall:
    """One Prefill or Decode call on a session."""

    __slots__ = ("_session", "call_id", "_items", "_waiter", "_error", "_ended", "_cancelled",
                 "_timer")

    def __init__(self, session: WorkerSession, call_id: int, timeout: float | None) -> None:
        self._session = session
        self.call_id = call_id
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._error: grpc.aio.AioRpcError | None = None
        self._ended = False
        self._cancelled = False
        self._timer = None if timeout is None else \
            asyncio.get_running_loop().call_later(timeout, self._expire)

    def deliver(self, event: pb.SessionEvent) -> None:
        body = event.WhichOneof("body")
        if body is not None:
            self._items.append(getattr(event, body))
        if event.end:
            code = _status(event.code)
            self._end(None if code == grpc.StatusCode.OK else rpc_error(code, event.details))
        else:
            self._wake()

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        if not self._ended:
            self._end(rpc_error(code, details))

    def _end(self, error: grpc.aio.AioRpcError | None) -> None:
        self._ended = True
        self._error = error
        if self._timer is not None:
            self._timer.cancel()
        self._session.forget(self.call_id)
        self._wake()

    def _expire(self) -> None:
        if not self._ended and not self._cancelled:
            self._session.send_cancel(self.call_id)
            self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read(self):
        while not self._items or self._cancelled:
            if self._cancelled:
                raise asyncio.CancelledError()
            if self._ended:
                if self._error is not None:
                    raise self._error
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def cancel(self) -> bool:
        if self._ended or self._cancelled:
            return False
        self._cancelled = True
        if self._timer is not None:
            self._timer.cancel()
        self._session.forget(self.call_id)
        self._session.send_cancel(self.call_id)
        self._wake()
        return True

    def done(self) -> bool:
        return self._ended or self._cancelled


class WorkerSession:
    """The session stream to one worker: opened on the first call, batched both ways."""

    def __init__(self, stub: pb_grpc.WorkerStub, metadata, address: str = "") -> None:
        self._stub = stub
        self._metadata = metadata
        self.address = address
        self.closed = False  # the stream broke or ended: open a new session for new calls
        self._retired = False  # no new calls: end the stream once the open ones are done
        self._calls: dict[int, SessionCall] = {}
        self._next_id = 1
        self._outgoing: list[pb.SessionCall] = []
        self._writer_waiter: asyncio.Future | None = None
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- calls -----------------------------------------------------------------------------

    def decode(self, request: pb.DecodeRequest, timeout: float | None) -> SessionCall:
        return self._open(pb.SessionCall(decode=request), timeout)

    def prefill(self, request: pb.PrefillRequest, timeout: float | None
                ) -> Coroutine[Any, Any, pb.PrefillResponse]:
        """The call goes out now (on the writer's next turn, before any call opened after it);
        the returned coroutine awaits its answer."""
        return self._answer(self._open(pb.SessionCall(prefill=request), timeout))

    async def _answer(self, call: SessionCall) -> pb.PrefillResponse:
        try:
            answer = await call.read()
        except asyncio.CancelledError:
            call.cancel()
            raise
        if answer is grpc.aio.EOF:
            raise rpc_error(grpc.StatusCode.INTERNAL, "the worker ended the call without an answer")
        return answer

    def _open(self, msg: pb.SessionCall, timeout: float | None) -> SessionCall:
        if self._stream is None:
            self._stream = self._stub.Session(metadata=self._metadata)
            self._tasks = [asyncio.ensure_future(self._write_loop()),
                           asyncio.ensure_future(self._read_loop())]
        msg.call_id = cid = self._next_id
        self._next_id += 1
        call = SessionCall(self, cid, timeout)
        if self.closed:
            call.fail(grpc.StatusCode.UNAVAILABLE, "the worker session is closed")
            return call
        self._calls[cid] = call
        self._send(msg)
        return call

    def forget(self, call_id: int) -> None:
        self._calls.pop(call_id, None)
        if self._retired and not self._calls:
            self._wake_writer()

    def send_cancel(self, call_id: int) -> None:
        if not self.closed:
            self._send(pb.SessionCall(call_id=call_id, cancel=True))

    def retire(self) -> None:
        """No more calls: the stream ends once the open calls are over."""
        self._retired = True
        self._wake_writer()

    # ---- the stream -------------------------------------------------------------------------

    def _send(self, msg: pb.SessionCall) -> None:
        self._outgoing.append(msg)
        self._wake_writer()

    def _wake_writer(self) -> None:
        waiter = self._writer_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _take(self) -> list[pb.SessionCall]:
        batch, self._outgoing = split_batch(self._outgoing, MAX_CALLS_BYTES)
        return batch

    async def _write_loop(self) -> None:
        stream = self._stream
        try:
            while True:
                while not self._outgoing:
                    if self._retired and not self._calls:
                        await stream.done_writing()
                        return
                    self._writer_waiter = asyncio.get_running_loop().create_future()
                    try:
                        await self._writer_waiter
                    finally:
                        self._writer_waiter = None
                await stream.write(pb.SessionCalls(calls=self._take()))
        except grpc.aio.AioRpcError as e:
            self._lost(e.code(), e.details() or "")
        except asyncio.InvalidStateError:  # the call ended under the write
            self._lost(grpc.StatusCode.UNAVAILABLE, "the worker session ended")
        except asyncio.CancelledError:
            self._lost(grpc.StatusCode.UNAVAILABLE,
                       "the call was cancelled (worker connection closed)")
            raise

    async def _read_loop(self) -> None:
        stream = self._stream
        try:
            while True:
                msg = await stream.read()
                if msg is grpc.aio.EOF:
                    self._lost(grpc.StatusCode.UNAVAILABLE, "the worker ended the session")
                    return
                if req_trace.enabled():
                    for event in msg.events:
                        if event.HasField("decode"):
                            req_trace.stamp("received", event.decode.request_id)
                        elif event.HasField("prefill"):
                            req_trace.stamp("reached", event.prefill.request_id)
                for event in msg.events:
                    call = self._calls.get(event.call_id)
                    if call is not None:
                        call.deliver(event)
        except grpc.aio.AioRpcError as e:
            self._lost(e.code(), e.details() or "")
        except asyncio.CancelledError:
            self._lost(grpc.StatusCode.UNAVAILABLE,
                       "the call was cancelled (worker connection closed)")
            raise

    def _lost(self, code: grpc.StatusCode, details: str) -> None:
        if self.closed:
            return
        self.closed = True
        calls, self._calls = list(self._calls.values()), {}
        if calls:
            log.warning("session to worker %s lost with %d calls open: %s: %s", self.address,
                        len(calls), code.name, details)
        for call in calls:
            call.fail(code, details)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        if self._stream is not None:
            self._stream.cancel()

    async def close(self) -> None:
        """Fail the open calls and end the stream now."""
        self._lost(grpc.StatusCode.UNAVAILABLE, "the router closed the session")
        await asyncio.gather(*self._tasks, return_exceptions=True)
