"""One attempt of a request on one (prefill, decode) pair with one room.

Prefill (unary) and Decode (server stream) run concurrently; whichever leg fails first raises
`LegFailure`, and the cleanup in `stream()` cancels the other leg and sends Abort to both.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from pdserve.engine.stop import TextStream
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.events import FlowEvent, TokenLogprob, Usage, merge_timings, timings_to_dict

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from pdserve.router.disagg import DisaggDecision
    from pdserve.router.prepare import PreparedRequest
    from pdserve.router.registry import WorkerEntry
    from pdserve.router.request_flow import RequestFlow

# How long the final message waits for the prefill answer (for its timings) after decode ended.
PREFILL_GRACE_S = 1.0
# While a leg is silent this long, the attempt checks that its worker is still in the registry
# and not unhealthy: a hung or stopped worker (no RST, so gRPC sees nothing) fails the attempt
# within a health-check round instead of waiting for the request deadline.
LIVENESS_CHECK_S = 1.0
STALL_MIN_S = 3.0  # ... once both legs were silent at least this long (and a health round)


class LegFailure(Exception):
    def __init__(self, worker: WorkerEntry, leg: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{leg} worker {worker.address} failed: {code.name}: {details}")
        self.worker, self.leg, self.code, self.details = worker, leg, code, details

    def message(self) -> str:
        return str(self)


@dataclass(eq=False)
class Attempt:
    flow: RequestFlow
    req: PreparedRequest
    prefill: WorkerEntry | None
    decode: WorkerEntry
    room: int
    prefill_req: pb.PrefillRequest | None
    decode_req: pb.DecodeRequest
    text: TextStream
    abort_event: asyncio.Event
    dispatch: float
    sent_tokens: bool = False
    decision: DisaggDecision | None = None
    _last_token_at: float = 0.0
    _cached_tokens: int = 0
    _prefill_timings: dict | None = None
    _ttft_ms: float = 0.0

    @property
    def prefill_addr(self) -> str:
        return self.prefill.address if self.prefill is not None else ""

    async def stream(self) -> AsyncIterator[FlowEvent]:
        legs = [w for w in (self.prefill, self.decode) if w is not None]
        timeout = max(0.001, self.flow.config.request_timeout_s
                      - (time.monotonic() - self.req.arrival))
        for w in legs:
            w.inflight += 1
        finished_by_worker = False
        prefill_task: asyncio.Task | None = None
        decode_call = None
        next_msg: asyncio.Task | None = None
        abort_wait = asyncio.ensure_future(self.abort_event.wait())
        last_heard = time.monotonic()
        try:
            if self.prefill is not None:
                prefill_task = asyncio.ensure_future(
                    self.prefill.open().Prefill(self.prefill_req, timeout=timeout,
                                                metadata=self.prefill.metadata))
            decode_call = self.decode.open().Decode(self.decode_req, timeout=timeout,
                                                    metadata=self.decode.metadata)
            next_msg = asyncio.ensure_future(decode_call.read())
            pending = {t for t in (next_msg, abort_wait, prefill_task) if t is not None}
            while True:
                done, _ = await asyncio.wait(pending, timeout=LIVENESS_CHECK_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    self._check_legs_alive(prefill_task, time.monotonic() - last_heard)
                    continue
                last_heard = time.monotonic()
                if prefill_task is not None and prefill_task in done:
                    pending.discard(prefill_task)
                    self._take_prefill(prefill_task)
                if abort_wait in done:
                    yield self._final(self.text.finish("abort"), [], None, "abort", None)
                    return
                if next_msg not in done:
                    continue
                pending.discard(next_msg)
                msg = self._decode_result(next_msg)
                event = self._consume(msg)
                if msg.finish_reason:
                    finished_by_worker = True
                if self.text.finished:
                    for w in legs:
                        self.flow.registry.report_success(w)
                    if prefill_task is not None and not prefill_task.done():
                        await asyncio.wait({prefill_task}, timeout=PREFILL_GRACE_S)
                        if prefill_task.done():
                            self._take_prefill(prefill_task, final=True)
                    yield self._final(event.text, event.token_ids, event.logprobs,
                                      self.text.finish_reason or "stop", msg)
                    return
                if event.token_ids:
                    self.sent_tokens = True
                    yield event
                next_msg = asyncio.ensure_future(decode_call.read())
                pending.add(next_msg)
        finally:
            for task in (next_msg, prefill_task, abort_wait):
                if task is not None and not task.done():
                    task.cancel()
            if decode_call is not None and not finished_by_worker:
                decode_call.cancel()
            for w in legs:
                w.inflight -= 1
            prefill_open = prefill_task is not None and not (
                prefill_task.done() and not prefill_task.cancelled())
            targets = legs if not finished_by_worker else (
                [self.prefill] if prefill_open and self.prefill is not None else [])
            if targets:
                self.flow.send_aborts(self.room, self.req.request_id, targets, "router abort")

    def _check_legs_alive(self, prefill_task: asyncio.Task | None, silent_s: float) -> None:
        cfg = self.flow.config
        if silent_s < max(STALL_MIN_S, cfg.health_check_interval_s + cfg.health_check_timeout_s):
            return
        registry = self.flow.registry
        legs = [("decode", self.decode)]
        if self.prefill is not None and prefill_task is not None and not prefill_task.done():
            legs.append(("prefill", self.prefill))
        for leg, worker in legs:
            entry = registry.get(worker.worker_id)
            if entry is None or entry.state == "unhealthy":
                why = "left the registry" if entry is None else "failed its health check"
                raise LegFailure(worker, leg, grpc.StatusCode.UNAVAILABLE,
                                 f"the worker {why} while serving the request")

    def _take_prefill(self, task: asyncio.Task, final: bool = False) -> None:
        if task.cancelled():  # its channel was closed (worker removed): not our cancellation
            if final:
                return
            raise LegFailure(self.prefill, "prefill", grpc.StatusCode.UNAVAILABLE,
                             "the call was cancelled (worker connection closed)")
        exc = task.exception()
        if isinstance(exc, grpc.aio.AioRpcError):
            if final:
                return  # decode already finished the request; prefill's late error is moot
            raise LegFailure(self.prefill, "prefill", exc.code(), exc.details() or "")
        if exc is not None:
            raise exc
        resp: pb.PrefillResponse = task.result()
        self._cached_tokens = max(self._cached_tokens, resp.cached_tokens)
        self._prefill_timings = timings_to_dict(resp.timings)

    def _decode_result(self, task: asyncio.Task) -> pb.DecodeResponse:
        if task.cancelled():  # its channel was closed (worker removed): not our cancellation
            raise LegFailure(self.decode, "decode", grpc.StatusCode.UNAVAILABLE,
                             "the call was cancelled (worker connection closed)")
        try:
            msg = task.result()
        except grpc.aio.AioRpcError as e:
            raise LegFailure(self.decode, "decode", e.code(), e.details() or "") from None
        if msg is grpc.aio.EOF:
            raise LegFailure(self.decode, "decode", grpc.StatusCode.UNAVAILABLE,
                             "stream ended without a finish reason")
        if msg.finish_reason == "abort" and not self.sent_tokens:
            raise LegFailure(self.decode, "decode", grpc.StatusCode.ABORTED,
                             "the worker aborted the request before its first token")
        return msg

    def _consume(self, msg: pb.DecodeResponse) -> FlowEvent:
        chunk = msg.chunk
        want_lp = self.req.sampling.logprobs is not None
        pieces: list[str] = []
        used: list[int] = []
        lps: list[TokenLogprob] | None = [] if want_lp else None
        tok = self.flow.tokenizer
        for i, tid in enumerate(chunk.token_ids):
            if self.text.finished:
                break
            pieces.append(self.text.push(tid)[0])
            used.append(tid)
            if lps is not None and i < len(chunk.logprobs):
                top = []
                if i < len(chunk.top_logprobs):
                    alt = chunk.top_logprobs[i]
                    top = [(t, tok.decode([t]), lp) for t, lp in zip(alt.token_ids, alt.logprobs)]
                lps.append(TokenLogprob(tid, tok.decode([tid]), chunk.logprobs[i], top))
        if msg.finish_reason and not self.text.finished:
            pieces.append(self.text.finish(msg.finish_reason))
        if msg.HasField("usage"):
            self._cached_tokens = max(self._cached_tokens, msg.usage.cached_tokens)
        now = time.monotonic()
        metrics = self.flow.metrics
        if used and metrics is not None:
            if not self.sent_tokens:
                metrics.on_first_token(now - self.req.arrival)
            else:
                metrics.on_tokens(now - self._last_token_at, len(used))
        if used and not self.sent_tokens:
            self._ttft_ms = (now - self.req.arrival) * 1000.0
        if used:
            self._last_token_at = now
        return FlowEvent(request_id=self.req.request_id, text="".join(pieces), token_ids=used,
                         logprobs=lps, prefill_worker=self.prefill_addr,
                         decode_worker=self.decode.address)

    def _final(self, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None,
               reason: str, msg: pb.DecodeResponse | None) -> FlowEvent:
        decode_timings = timings_to_dict(msg.timings) if msg is not None and msg.HasField(
            "timings") else {}
        router = {"queue_ms": (self.dispatch - self.req.arrival) * 1000.0}
        timings = merge_timings(self._prefill_timings or {}, decode_timings, router)
        if self._ttft_ms:
            timings["ttft_ms"] = self._ttft_ms  # what the client saw, not a worker's view
        usage = Usage(prompt_tokens=len(self.req.input_ids),
                      completion_tokens=self.text.num_output_tokens,
                      cached_tokens=min(self._cached_tokens, len(self.req.input_ids)))
        if self.flow.metrics is not None:
            self.flow.metrics.on_finish(reason, usage, timings)
        return FlowEvent(request_id=self.req.request_id, text=text, token_ids=token_ids,
                         logprobs=logprobs, finish_reason=reason, usage=usage, timings=timings,
                         prefill_worker=self.prefill_addr, decode_worker=self.decode.address,
                         disagg=self.decision.to_json() if self.decision is not None else None)
