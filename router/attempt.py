"""One attempt of a request on one (prefill, decode) pair with one room.

Prefill (unary) and Decode (server stream) run concurrently; whichever leg fails first raises
`LegFailure`, and the cleanup in `stream()` cancels the other leg and sends Abort to both.

The first token streams from whichever leg has it first: prefill answers as soon as it is
sampled (the KV still on its way), decode's stream starts with the same token (it continues
from it), and that copy is then skipped. `first_only` says that the caller has seen the first
token and nothing from decode yet: a failure then may be retried as a continuation.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from pdserve.engine import req_trace
from pdserve.engine.stop import TextStream
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.events import (
    AbortSignal,
    FlowEvent,
    TokenLogprob,
    Usage,
    merge_timings,
    timings_to_dict,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from pdserve.router.disagg import DisaggDecision
    from pdserve.router.prepare import PreparedRequest
    from pdserve.router.registry import WorkerEntry
    from pdserve.router.request_flow import RequestFlow
    from pdserve.router.session import SessionCall

# How long the final message waits for the prefill answer (for its timings) after decode ended.
PREFILL_GRACE_S = 1.0
# While a leg is silent this long, the attempt checks that its worker is still in the registry
# and not unhealthy: a hung or stopped worker (no RST, so gRPC sees nothing) fails the attempt
# within a health-check round instead of waiting for the request deadline.
LIVENESS_CHECK_S = 1.0
STALL_MIN_S = 3.0  # ... once both legs were silent at least this long (and a health round)


def _cancelling() -> bool:
    """The running task has been asked to cancel (Python 3.11+; on 3.10 never known)."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


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
    abort_event: AbortSignal
    dispatch: float
    sent_tokens: bool = False
    decision: DisaggDecision | None = None
    first_token_id: int | None = None  # the prefill answer's, once streamed
    _last_token_at: float = 0.0
    _cached_tokens: int = 0
    _prefill_timings: dict | None = None
    _ttft_ms: float = 0.0
    _decode_call: SessionCall | grpc.aio.UnaryStreamCall | None = None
    _interrupt: str | LegFailure | None = None  # "abort", or the failure that ends the attempt
    _finishing: bool = False  # the answer is complete (or the attempt over): no interrupts
    _last_heard: float = 0.0
    _watchdog: asyncio.TimerHandle | None = None
    _prefill_seen: bool = False
    _prefill_first: pb.TokenChunk | None = None  # the prefill answer's first token
    _skip_decode_first: bool = False  # it was streamed: decode's copy is skipped
    _decode_tokens: bool = False  # decode's stream has had a token

    def resume_from(self, before: Attempt) -> None:
        """Carry what the caller has seen from the attempt this one continues."""
        self.sent_tokens = True
        self._ttft_ms, self._last_token_at = before._ttft_ms, before._last_token_at

    @property
    def first_only(self) -> bool:
        """The caller has the first token (from prefill) and nothing from decode."""
        return self._skip_decode_first and not self._decode_tokens

    @property
    def prefill_addr(self) -> str:
        return self.prefill.address if self.prefill is not None else ""

    async def stream(self) -> AsyncIterator[FlowEvent]:
        """The attempt's events. Per decode message it only awaits the next read: the abort
        event, the prefill answer and the liveness watchdog are callbacks that interrupt that
        read (by cancelling the decode call) when they end the attempt."""
        legs = [w for w in (self.prefill, self.decode) if w is not None]
        if req_trace.enabled():
            req_trace.stamp("arrival", self.req.request_id, self.req.arrival)
            req_trace.stamp("dispatch", self.req.request_id)
        timeout = max(0.001, self.flow.config.request_timeout_s
                      - (time.monotonic() - self.req.arrival))
        loop = asyncio.get_running_loop()
        for w in legs:
            w.inflight += 1
        finished_by_worker = False
        prefill_task: asyncio.Task | None = None
        pending_read: asyncio.Future | None = None  # decode's read while the prefill answers
        unsubscribe = None
        self._last_heard = time.monotonic()
        try:
            if self.prefill is not None:
                prefill_task = asyncio.ensure_future(
                    self.prefill.prefill_call(self.prefill_req, timeout))
                prefill_task.add_done_callback(self._on_prefill)
            self._decode_call = self.decode.decode_call(self.decode_req, timeout)
            self._watchdog = loop.call_later(LIVENESS_CHECK_S, self._watch, prefill_task)
            unsubscribe = self.abort_event.subscribe(lambda: self._interrupt_with("abort"))
            while True:
                msg = None
                if pending_read is None and prefill_task is not None and \
                        not prefill_task.done() and not self.sent_tokens:
                    pending_read = asyncio.ensure_future(self._read())
                    await asyncio.wait({pending_read, prefill_task},
                                       return_when=asyncio.FIRST_COMPLETED)
                event = None
                if pending_read is not None and not pending_read.done():
                    # The prefill answered before decode's first message: its first token
                    # goes out now, decode's message is read next.
                    self._on_prefill(prefill_task)
                    if self._interrupt is None:
                        event = self._first_of_prefill()
                if event is None:
                    if pending_read is not None:
                        read, pending_read = pending_read, None
                        msg = await read
                    else:
                        msg = await self._read()
                    if prefill_task is not None and prefill_task.done():
                        self._on_prefill(prefill_task)  # before its callback: it outranks decode
                    if self._interrupt is not None:  # also when it raced a message that arrived
                        msg = None
                    if msg is None:  # interrupted
                        if self._interrupt == "abort":
                            yield self._final(self.text.finish("abort"), [], None, "abort",
                                              None)
                            return
                        raise self._interrupt  # a LegFailure
                    self._last_heard = time.monotonic()
                    event = self._consume(msg)
                    if msg.finish_reason:
                        finished_by_worker = True
                if self.text.finished:
                    self._finishing = True
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
        finally:
            self._finishing = True
            if pending_read is not None and not pending_read.done():
                pending_read.cancel()
            if self._watchdog is not None:
                self._watchdog.cancel()
            if unsubscribe is not None:
                unsubscribe()
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
            if self._decode_call is not None and not finished_by_worker:
                self._decode_call.cancel()
            for w in legs:
                w.inflight -= 1
            prefill_open = prefill_task is not None and not (
                prefill_task.done() and not prefill_task.cancelled())
            targets = legs if not finished_by_worker else (
                [self.prefill] if prefill_open and self.prefill is not None else [])
            if targets:
                self.flow.send_aborts(self.room, self.req.request_id, targets, "router abort")

    async def _read(self) -> pb.DecodeResponse | None:
        """The next decode message; None once an interrupt (`_interrupt`) cancelled the call.
        Raises LegFailure when the decode leg fails."""
        call = self._decode_call
        try:
            msg = await call.read()
        except asyncio.CancelledError:
            if _cancelling():
                raise  # the caller is being cancelled
            if self._interrupt is not None:
                return None
            # Cancelled by neither: its channel was closed (the worker left the registry).
            raise LegFailure(self.decode, "decode", grpc.StatusCode.UNAVAILABLE,
                             "the call was cancelled (worker connection closed)") from None
        except grpc.aio.AioRpcError as e:
            if self._interrupt is not None:
                return None
            raise LegFailure(self.decode, "decode", e.code(), e.details() or "") from None
        if msg is grpc.aio.EOF:
            raise LegFailure(self.decode, "decode", grpc.StatusCode.UNAVAILABLE,
                             "stream ended without a finish reason")
        if msg.finish_reason == "abort" and (not self.sent_tokens or self.first_only):
            raise LegFailure(self.decode, "decode", grpc.StatusCode.ABORTED,
                             "the worker aborted the request before its first token")
        return msg

    def _interrupt_with(self, why: str | LegFailure) -> None:
        """End the attempt from a callback: the pending read returns None."""
        if self._interrupt is not None or self._finishing:
            return
        self._interrupt = why
        if self._decode_call is not None:
            self._decode_call.cancel()

    def _on_prefill(self, task: asyncio.Task) -> None:
        if self._finishing or self._prefill_seen:
            return
        self._prefill_seen = True
        self._last_heard = time.monotonic()
        try:
            self._take_prefill(task)
        except LegFailure as failure:
            self._interrupt_with(failure)

    def _watch(self, prefill_task: asyncio.Task | None) -> None:
        """Every LIVENESS_CHECK_S: fail the attempt when a silent leg's worker is gone."""
        if self._finishing or self._interrupt is not None:
            return
        try:
            self._check_legs_alive(prefill_task, time.monotonic() - self._last_heard)
        except LegFailure as failure:
            self._interrupt_with(failure)
            return
        self._watchdog = asyncio.get_running_loop().call_later(LIVENESS_CHECK_S, self._watch,
                                                               prefill_task)

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
        if not resp.finish_reason and len(resp.first_token.token_ids) == 1:
            self._prefill_first = resp.first_token  # one that finishes comes with decode's end

    def _first_of_prefill(self) -> FlowEvent | None:
        """The prefill answer's first token as an event, once, when decode has sent none."""
        chunk, self._prefill_first = self._prefill_first, None
        if chunk is None or self.sent_tokens or self.text.finished:
            return None
        self._skip_decode_first = True
        self.first_token_id = chunk.token_ids[0]
        return self._tokens(list(chunk.token_ids), chunk, "")

    def _consume(self, msg: pb.DecodeResponse) -> FlowEvent:
        """A decode message's tokens (one or more: a stream that fell behind catches up in
        fewer messages) through the text stream, as one event; the first token skipped when
        the prefill answer already streamed it."""
        chunk = msg.chunk
        ids = list(chunk.token_ids)
        skip = 0
        if ids and not self._decode_tokens:
            self._decode_tokens = True
            skip = int(self._skip_decode_first)
        if msg.HasField("usage"):
            self._cached_tokens = max(self._cached_tokens, msg.usage.cached_tokens)
        return self._tokens(ids[skip:], chunk, msg.finish_reason, skip)

    def _tokens(self, ids: list[int], chunk: pb.TokenChunk, finish_reason: str, skip: int = 0
                ) -> FlowEvent:
        """`ids` (chunk's tokens from index `skip`) through the text stream, as one event."""
        text = ""
        used: list[int] = []
        if ids and not self.text.finished:
            before = self.text.num_output_tokens
            text = self.text.push_many(ids)[0]
            used = ids[:self.text.num_output_tokens - before]
        lps: list[TokenLogprob] | None = None
        if self.req.sampling.logprobs is not None:
            lps = self._logprobs(chunk, used, skip)
        if finish_reason and not self.text.finished:
            text += self.text.finish(finish_reason)
        if used:
            now = time.monotonic()
            metrics = self.flow.metrics
            if not self.sent_tokens:
                self._ttft_ms = (now - self.req.arrival) * 1000.0
                req_trace.stamp("first", self.req.request_id, now)
                if metrics is not None:
                    metrics.on_first_token(now - self.req.arrival)
            elif metrics is not None:
                metrics.on_tokens(now - self._last_token_at, len(used))
            self._last_token_at = now
        return FlowEvent(request_id=self.req.request_id, text=text, token_ids=used,
                         logprobs=lps, prefill_worker=self.prefill_addr,
                         decode_worker=self.decode.address)

    def _logprobs(self, chunk: pb.TokenChunk, used: list[int], skip: int = 0
                  ) -> list[TokenLogprob]:
        decode = self.flow.decode_token
        out = []
        for i, tid in enumerate(used[:max(0, len(chunk.logprobs) - skip)]):
            top = []
            if skip + i < len(chunk.top_logprobs):
                alt = chunk.top_logprobs[skip + i]
                top = [(t, decode(t), lp) for t, lp in zip(alt.token_ids, alt.logprobs)]
            out.append(TokenLogprob(tid, decode(tid), chunk.logprobs[skip + i], top))
        return out

    def _final(self, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None,
               reason: str, msg: pb.DecodeResponse | None) -> FlowEvent:
        decode_timings = timings_to_dict(msg.timings) if msg is not None and msg.HasField(
            "timings") else {}
        router = {"queue_ms": (self.dispatch - self.req.arrival) * 1000.0}
        timings = merge_timings(self._prefill_timings or {}, decode_timings, router)
        if self._ttft_ms:
            timings["ttft_ms"] = self._ttft_ms  # what the client saw, not a worker's view
        prompt = len(self.req.input_ids) - self.req.generated
        usage = Usage(prompt_tokens=prompt, completion_tokens=self.text.num_output_tokens,
                      cached_tokens=min(self._cached_tokens, prompt))
        if self.flow.metrics is not None:
            self.flow.metrics.on_finish(reason, usage, timings)
        return FlowEvent(request_id=self.req.request_id, text=text, token_ids=token_ids,
                         logprobs=logprobs, finish_reason=reason, usage=usage, timings=timings,
                         prefill_worker=self.prefill_addr, decode_worker=self.decode.address,
                         disagg=self.decision.to_json() if self.decision is not None else None)
