"""One request through the workers: pick (P, D), room, Prefill + Decode, relay, retry, abort.

Invariants:
- Every attempt that did not end with the decode worker reporting a finish sends Abort (room +
  request_id) to both legs: on stop strings, client disconnect, cancellation, a failed leg.
- A failure before the first token reached the caller is retried (`config.retries` times) with
  a fresh pair and a fresh room; after that the stream ends with an error event. So is one
  after only the prefill answer's first token reached it (router/attempt.py): the retry
  continues from that token (the prompt plus it, one token fewer to generate, the same text
  stream), unless penalties count the output (the continuation would not see it as output).
- A request that finds the queue in front of the workers full is refused before anything is
  sent (429, router/admission.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import grpc

from pdserve.engine.detokenizer import decode_fn
from pdserve.engine.stop import TextStream
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.rpc import sampling_to_proto
from pdserve.router.admission import QueueGate
from pdserve.router.attempt import Attempt, LegFailure
from pdserve.router.config import RouterConfig
from pdserve.router.disagg import DisaggDecision, DisaggPolicy
from pdserve.router.errors import InvalidRequest, NoWorkers, RequestTimeout, UpstreamFailed
from pdserve.router.events import AbortSignal, FlowEvent
from pdserve.router.policies import Policy
from pdserve.router.prepare import PreparedRequest, eos_token_ids
from pdserve.router.registry import Registry, WorkerEntry
from pdserve.router.slo_dispatch import SloDispatcher

log = logging.getLogger(__name__)


def continuation(req: PreparedRequest, attempt: Attempt) -> PreparedRequest | None:
    """The request that resumes `attempt` after its caller got the prefill answer's first token
    and nothing more; None when it cannot be resumed (more was streamed, or penalties would
    miss the token as output)."""
    sp = req.sampling
    if not attempt.first_only or attempt.first_token_id is None or sp.max_tokens < 2 or (
            sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty):
        return None
    sampling = dataclasses.replace(sp, max_tokens=sp.max_tokens - 1,
                                   min_tokens=max(0, sp.min_tokens - 1))
    return PreparedRequest(request_id=req.request_id,
                           input_ids=[*req.input_ids, attempt.first_token_id],
                           sampling=sampling, arrival=req.arrival, generated=req.generated + 1)


class RequestFlow:
    """Runs requests; `run` is an async generator of FlowEvents (close it to cancel)."""

    def __init__(self, config: RouterConfig, registry: Registry, prefill_policy: Policy,
                 decode_policy: Policy, tokenizer: Any, metrics: Any = None) -> None:
        self.config = config
        self.registry = registry
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.eos_ids = eos_token_ids(tokenizer)
        self._decode = decode_fn(tokenizer)
        self.disagg = DisaggPolicy(config.disagg_threshold)
        self.gate = QueueGate(config.max_queued_requests, registry)
        self.slo = SloDispatcher(config.slo_ttft_ms, config.slo_itl_ms) \
            if config.slo_ttft_ms > 0 else None
        self._active: dict[str, AbortSignal] = {}
        self._background: set[asyncio.Task] = set()

    def decode_token(self, token_id: int) -> str:
        """One token's text, special tokens kept (logprobs name every token)."""
        return self._decode([token_id], False)

    def pick(self, input_ids: list[int], exclude: set[str] = frozenset()
             ) -> tuple[WorkerEntry | None, WorkerEntry, DisaggDecision]:
        """(prefill, decode, decision); prefill is None when the decode (or mixed) worker
        prefills the prompt itself (see router/disagg.py for when). Workers in `exclude` (failed
        this request) are avoided when others exist."""
        def pool(role: str) -> list[WorkerEntry]:
            live = self.registry.available(role)
            fresh = [w for w in live if w.worker_id not in exclude]
            return fresh or live

        prefill, decode = pool("prefill"), pool("decode")
        if decode:
            self.disagg.forget_except(self.registry.all())
            chosen = self.decode_policy.pick(decode, input_ids)
            review = None
            if self.slo is not None:
                self.slo.forget_except(self.registry.all())
                review = partial(self.slo.review, prefill=prefill, decode=chosen)
            decision = self.disagg.decide(input_ids, chosen, bool(prefill),
                                          self.config.local_prefill_fallback, review)
            if decision is not None:
                if decision.disaggregated:
                    return self.prefill_policy.pick(prefill, input_ids), chosen, decision
                return None, chosen, decision
        mixed = pool("mixed")
        if mixed:
            return (None, self.decode_policy.pick(mixed, input_ids),
                    DisaggPolicy.mixed(input_ids, self.config.disagg_threshold))
        roles = {w.role: w.state for w in self.registry.all()}
        raise NoWorkers(f"no workers available to serve the request (workers: {roles or 'none'})",
                        code="no_workers")

    async def abort(self, request_id: str) -> bool:
        """Abort a running request by id (Router.Abort); its stream ends with "abort"."""
        event = self._active.get(request_id)
        if event is None:
            return False
        event.set()
        return True

    async def run(self, req: PreparedRequest) -> AsyncIterator[FlowEvent]:
        if req.request_id in self._active:
            raise InvalidRequest(f"request_id: {req.request_id!r} is already running",
                                 param="request_id")
        self.gate.admit()
        abort_event = AbortSignal()
        self._active[req.request_id] = abort_event
        exclude: set[str] = set()
        last_failure: LegFailure | None = None
        before: Attempt | None = None  # the attempt a continuation resumes
        try:
            for attempt_no in range(self.config.retries + 1):
                try:
                    prefill, decode, decision = self.pick(req.input_ids, exclude)
                except NoWorkers:
                    if last_failure is None:
                        raise
                    raise UpstreamFailed(last_failure.message(), code="worker_failed") from None
                if self.metrics is not None:
                    self.metrics.on_disagg(decision)
                attempt = self._make_attempt(req, prefill, decode, abort_event, before)
                attempt.decision = decision
                stream = attempt.stream()
                if self.slo is not None:
                    stream = self.slo.watch(stream, prefill or decode, decode,
                                            decision.uncached_len)
                try:
                    async with contextlib.aclosing(stream) as events:
                        async for event in events:
                            yield event
                    return
                except LegFailure as failure:
                    self._note_failure(failure)
                    last_failure = failure
                    exclude.add(failure.worker.worker_id)
                    if failure.leg == "decode" and prefill is not None:
                        exclude.add(prefill.worker_id)  # a fresh pair, not only a fresh leg
                    # A request a worker called invalid is invalid on every worker of the model.
                    last = attempt_no == self.config.retries or \
                        failure.code == grpc.StatusCode.INVALID_ARGUMENT
                    resume = None if last else continuation(req, attempt)
                    if attempt.sent_tokens and resume is None:
                        yield FlowEvent(request_id=req.request_id, error=failure.message(),
                                        prefill_worker=attempt.prefill_addr,
                                        decode_worker=decode.address)
                        return
                    if resume is not None:
                        req, before = resume, attempt
                    if last:
                        if failure.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                            raise RequestTimeout(failure.message(), code="timeout") from None
                        raise UpstreamFailed(failure.message(), code="worker_failed") from None
                    log.warning("request %s: %s; retrying with a fresh pair", req.request_id,
                                failure.message())
                    if self.metrics is not None:
                        self.metrics.on_retry()
        finally:
            self._active.pop(req.request_id, None)
            self.gate.finished()

    def _make_attempt(self, req: PreparedRequest, prefill: WorkerEntry | None,
                      decode: WorkerEntry, abort_event: AbortSignal,
                      before: Attempt | None = None) -> Attempt:
        room = secrets.randbits(63)
        sampling = sampling_to_proto(req.sampling)
        prefill_req = None
        if prefill is not None:
            prefill_req = pb.PrefillRequest(request_id=req.request_id, input_ids=req.input_ids,
                                            sampling=sampling, room=room,
                                            decode_addr=decode.address)
        decode_req = pb.DecodeRequest(
            request_id=req.request_id, input_ids=req.input_ids, sampling=sampling, room=room,
            bootstrap_addr=prefill.bootstrap_addr if prefill is not None else "")
        if before is not None:  # a continuation: the caller's stream goes on
            attempt = Attempt(flow=self, req=req, prefill=prefill, decode=decode, room=room,
                              prefill_req=prefill_req, decode_req=decode_req, text=before.text,
                              abort_event=abort_event, dispatch=before.dispatch)
            attempt.resume_from(before)
            return attempt
        text = TextStream.from_params(self.tokenizer, req.sampling, self.eos_ids, req.input_ids)
        return Attempt(flow=self, req=req, prefill=prefill, decode=decode, room=room,
                       prefill_req=prefill_req, decode_req=decode_req, text=text,
                       abort_event=abort_event, dispatch=time.monotonic())

    def _note_failure(self, failure: LegFailure) -> None:
        if failure.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.registry.report_failure(failure.worker)

    def send_aborts(self, room: int, request_id: str, workers: list[WorkerEntry],
                    reason: str) -> None:
        """Fire-and-forget Abort to each leg; safe to call from a cancelled task's cleanup."""
        for worker in workers:
            stub = worker.stub
            if stub is None:
                continue
            msg = pb.AbortRequest(request_id=request_id, room=room, reason=reason)
            task = asyncio.get_running_loop().create_task(self._abort_one(stub, worker, msg))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _abort_one(self, stub: Any, worker: WorkerEntry, msg: pb.AbortRequest) -> None:
        try:
            await stub.Abort(msg, timeout=self.config.health_check_timeout_s,
                             metadata=worker.metadata)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            log.info("abort of room %d on %s failed: %s", msg.room, worker.address, e)

    async def drain_background(self) -> None:
        """Wait for in-flight Abort RPCs (shutdown, tests)."""
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
