"""Base of the Worker gRPC servicers: Status, Abort, and the request registry by room."""

from __future__ import annotations

import asyncio
import secrets

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_thread import SchedulerThread
from pdserve.engine.worker_common import (
    BadRequest,
    check_input_ids,
    load_message,
    sampling_from_wire,
)
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc


class WorkerServiceBase(pb_grpc.WorkerServicer):
    role = "worker"

    def __init__(self, thread: SchedulerThread, model_config, memory, model_name: str,
                 transfer_backend: str = "") -> None:
        self.thread = thread
        self.model_config = model_config
        self.memory = memory
        self.model_name = model_name
        self.transfer_backend = transfer_backend
        self.address = ""
        self.bootstrap_addr = ""
        self.draining = False
        self.worker_id = f"{self.role}-{secrets.token_hex(4)}"
        self.rid_by_room: dict[int, str] = {}
        self.rid_by_request: dict[str, str] = {}  # client request id -> latest internal rid
        self.live: set[str] = set()  # internal rids between arrival and the end of their RPC

    # ---- helpers -----------------------------------------------------------------------------

    async def accept(self, request, context, room_error: str | None
                     ) -> tuple[str, list[int], SamplingParams]:
        """Validate a Prefill/Decode request and claim its (request id, room).

        `room_error`: the message when the request needs a room and has none (None: no room
        needed). Aborts the call with INVALID_ARGUMENT / ALREADY_EXISTS / UNAVAILABLE.
        """
        await self.check_serving(context)
        vocab = self.model_config.vocab_size
        try:
            sp = sampling_from_wire(request.sampling, vocab)
            ids = list(request.input_ids)
            check_input_ids(ids, vocab, self.memory.max_context_len, sp.max_tokens)
            if room_error is not None and request.room == 0:
                raise BadRequest(room_error)
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            rid = self.enter(request.request_id, request.room)
        except ValueError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return rid, ids, sp

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

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            worker_id=self.worker_id, role=self.role, address=self.address,
            bootstrap_addr=self.bootstrap_addr, model=self.model_name,
            state="draining" if self.draining else "healthy", load=self.load(),
            page_size=self.memory.page_size, max_context_len=self.memory.max_context_len,
            transfer_backend=self.transfer_backend)

    def load(self) -> pb.WorkerLoad:
        return load_message(self.thread.snapshot)

    def submit_abort(self, rid: str, reason: str) -> None:
        sched = self.thread.scheduler
        self.thread.submit(lambda: sched.abort(rid, reason))

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
