"""Base of the Worker gRPC servicers: request admission, Status, Abort, the registry by room.

A role's servicer (prefill/server.py, decode/server.py) validates a request once
(`accept`), builds its role's Req with a ReqChannel as the event sink, hands it to the scheduler
thread (`submit_add`) and turns the typed events it gets back into RPC answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Sequence

import grpc

from pdserve.engine import req_trace
from pdserve.engine.req import Req
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.proto.rpc import load_from_dict, token_chunk
from pdserve.worker.events import (
    ErrorEvent,
    EventPump,
    EventSink,
    ReqChannel,
    StageTimes,
    TokenOutput,
)
from pdserve.worker.scheduler_thread import SchedulerThread
from pdserve.worker.session import serve_session
from pdserve.worker.validate import BadRequest, ValidRequest, validate_request


def chunk_of(tokens: TokenOutput) -> pb.TokenChunk:
    return token_chunk(tokens.token_ids, tokens.logprobs, tokens.top_logprobs)


def timings_of(times: StageTimes) -> pb.StageTimings:
    return pb.StageTimings(**dataclasses.asdict(times))


class WorkerServiceBase(pb_grpc.WorkerServicer):
    role = "worker"

    def __init__(self, thread: SchedulerThread, model_config, memory, model_name: str,
                 transfer_backend: str = "", bootstrap_addr: str = "",
                 transfer_backends: Sequence[str] = ()) -> None:
        self.thread = thread
        self.model_config = model_config
        self.memory = memory
        self.model_name = model_name
        self.transfer_backend = transfer_backend
        self.transfer_backends = list(transfer_backends)  # offered (decode) / usable (prefill)
        self.address = ""
        self.bootstrap_addr = bootstrap_addr
        self.draining = False
        self.worker_id = f"{self.role}-{secrets.token_hex(4)}"
        self.rid_by_room: dict[int, str] = {}
        self.rid_by_request: dict[str, str] = {}  # client request id -> latest internal rid
        self.live: set[str] = set()  # internal rids between arrival and the end of their RPC
        self.warmup_s: dict[str, float] = {}  # path -> seconds, run before registering
        self._pump: EventPump | None = None

    # ---- helpers -----------------------------------------------------------------------------

    def channel(self) -> ReqChannel:
        """A new request's event channel (on the serving loop; one pump for all requests)."""
        if self._pump is None:
            self._pump = EventPump(asyncio.get_running_loop())
        return ReqChannel(self._pump)

    async def accept(self, request: pb.PrefillRequest | pb.DecodeRequest,
                     context: grpc.aio.ServicerContext, room_error: str | None
                     ) -> tuple[str, ValidRequest]:
        """Validate a Prefill/Decode request and claim its (request id, room).

        `room_error`: the message when the request needs a room and has none (None: no room
        needed). Aborts the call with INVALID_ARGUMENT / ALREADY_EXISTS / UNAVAILABLE.
        """
        req_trace.stamp(self._stage("accept"), request.request_id)
        await self.check_serving(context)
        try:
            valid = validate_request(request, self.model_config.vocab_size,
                                     self.memory.max_context_len, room_error)
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            rid = self.enter(request.request_id, request.room)
        except ValueError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return rid, valid

    def _stage(self, stage: str) -> str:
        """A request-trace stage under this worker's name for it: a decode worker's own (its
        prefill worker stamps the same request's accept, queued and added)."""
        return f"decode-{stage}" if self.role == "decode" else stage

    def enter(self, request_id: str, room: int) -> str:
        """Register an arriving request; returns its internal id. A retried request reuses
        its request id with a fresh room, so the scheduler keys requests by both: a late
        Abort of the failed attempt (by room) never hits the retry."""
        rid = f"{request_id or 'req'}@{room}"
        if rid in self.live:
            raise ValueError(f"room: {room} is already in use on this worker")
        self.live.add(rid)
        if room:
            self.rid_by_room[room] = rid
        if request_id:
            self.rid_by_request[request_id] = rid
        return rid

    def leave(self, request_id: str, room: int, rid: str) -> None:
        self.live.discard(rid)
        if self.rid_by_room.get(room) == rid:
            del self.rid_by_room[room]
        if self.rid_by_request.get(request_id) == rid:
            del self.rid_by_request[request_id]

    def submit_add(self, req: Req, sink: EventSink) -> None:
        """Queue `req` on the scheduler thread; a refusal there ends its events with an error."""
        sched = self.thread.scheduler
        queued, added = self._stage("queued"), self._stage("added")

        def add() -> None:
            req_trace.stamp(queued, req.rid)
            try:
                sched.add(req)
                req_trace.stamp(added, req.rid)
            except (ValueError, RuntimeError, OSError) as e:
                sink.put(ErrorEvent(f"rejected: {e}"))

        self.thread.submit(add)

    def submit_abort(self, rid: str, reason: str) -> None:
        sched = self.thread.scheduler
        self.thread.submit(lambda: sched.abort(rid, reason))

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            worker_id=self.worker_id, role=self.role, address=self.address,
            bootstrap_addr=self.bootstrap_addr, model=self.model_name,
            state="draining" if self.draining else "healthy", load=self.load(),
            page_size=self.memory.page_size, max_context_len=self.memory.max_context_len,
            transfer_backend=self.transfer_backend, transfer_backends=self.transfer_backends,
            warmup_s=self.warmup_s, session=True)

    def load(self) -> pb.WorkerLoad:
        return load_from_dict(self.thread.snapshot)

    async def check_serving(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        if self.thread.error is not None or not self.thread.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"scheduler stopped: {self.thread.error!r}")

    async def wait_idle(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.live and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self.live

    # ---- RPCs --------------------------------------------------------------------------------

    async def Session(self, request_iterator, context):
        """Prefill and Decode calls multiplexed over one stream (worker/session.py)."""
        async for batch in serve_session(self, request_iterator):
            yield batch

    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        return pb.StatusResponse(info=self.info())

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        if request.room:  # an attempt: only that room, never a retry of the same request
            rid = self.rid_by_room.get(request.room, "")
        else:
            rid = self.rid_by_request.get(request.request_id, "")
        found = bool(rid) and rid in self.live
        if rid:
            self.submit_abort(rid, request.reason or "aborted by router")
        return pb.AbortResponse(found=found)
