"""What a scheduler tells a request's RPC handler, and the channel that carries it.

The scheduler thread produces typed events for one request; the request's asyncio handler
consumes them. A request's events end with exactly one FinishEvent, PrefilledEvent (prefill
worker: the first token is sampled and the last KV chunk queued) or ErrorEvent; the channel
drops anything put after that.

Events cross from the scheduler thread to the loop in batches (`EventPump`): a decode step puts
one event per running request, and waking the loop once per event (a syscall and a callback
each, while the scheduler holds the GIL) would cost the step more than the events themselves.
A request's handler takes every event that arrived since it last looked (`get_batch`), so when
it falls behind, its tokens leave in fewer, larger messages; in order, none dropped.

A request's first message is handed over (`hand_over`, decode/scheduler.py): the scheduler
thread waits, the GIL released, until the loop has taken what was posted. Otherwise the loop,
woken, waits for the GIL while the scheduler prepares its next step, up to the switch interval
(0.5 ms in a worker, pdserve/pauses.py) before the token moves on.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.req import Req

HAND_OVER_S = 0.001  # the longest a first token's hand-over holds the scheduler thread


@dataclass(frozen=True)
class TokenOutput:
    """Tokens appended to a request in one step (or several), with their logprobs when the
    request asked for them: one logprob per token, and one (ids, logprobs) list of top
    alternatives per token when it asked for k > 0."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)

    @classmethod
    def last_of(cls, req: Req, num: int) -> TokenOutput:
        if num <= 0:
            return cls()
        lps = req.output_logprobs[-num:] if req.sampling.logprobs is not None else []
        top = req.output_top_logprobs[-num:] if req.sampling.logprobs else []
        return cls(req.output_ids[-num:], list(lps), list(top))

    @classmethod
    def concat(cls, parts: list[TokenOutput]) -> TokenOutput:
        """The tokens of consecutive outputs of one request as one output."""
        if len(parts) == 1:
            return parts[0]
        return cls([t for p in parts for t in p.token_ids],
                   [lp for p in parts for lp in p.logprobs],
                   [top for p in parts for top in p.top_logprobs])


@dataclass(frozen=True)
class StageTimes:
    """Milliseconds per stage, as measured by this worker (proto StageTimings)."""

    queue_ms: float = 0.0
    bootstrap_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0


@dataclass(frozen=True)
class TokensEvent:
    tokens: TokenOutput


@dataclass(frozen=True)
class FinishEvent:
    """The request ended; `tokens` are the finishing step's (they travel with the finish, so a
    client that stops reading at its last token still gets usage and timings)."""

    reason: str
    tokens: TokenOutput
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: StageTimes


@dataclass(frozen=True)
class PrefilledEvent:
    """Prefill worker: the prompt is in KV and its first token sampled (it travels to decode in
    the aux data, and to the router in the answer); the last KV chunk is queued next."""

    cached_tokens: int
    finish_reason: str
    timings: StageTimes
    first: TokenOutput = field(default_factory=TokenOutput)


@dataclass(frozen=True)
class ErrorEvent:
    message: str


WorkerEvent = TokensEvent | FinishEvent | PrefilledEvent | ErrorEvent
_FINAL = (FinishEvent, PrefilledEvent, ErrorEvent)


class EventSink(Protocol):
    """What a scheduler needs from a request's handler: somewhere to put its events. Called on
    the scheduler thread; must not block."""

    def put(self, event: WorkerEvent) -> None: ...

    def hand_over(self) -> None:
        """Wait briefly (GIL released) until the loop has taken what was put: after a
        request's first message."""


class EventPump:
    """Carries events from the scheduler thread to one asyncio loop: whatever was posted before
    the loop got to it is delivered by one callback (one wake-up), in posting order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[ReqChannel, WorkerEvent]] = []
        self._scheduled = False
        self._taken = threading.Event()  # clear while a flush is scheduled and has not run
        self._taken.set()

    def post(self, channel: ReqChannel, event: WorkerEvent) -> None:
        with self._lock:
            self._pending.append((channel, event))
            if self._scheduled:
                return
            self._scheduled = True
            self._taken.clear()
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            with self._lock:
                self._taken.set()

    def hand_over(self, timeout_s: float = HAND_OVER_S) -> None:
        """On the posting thread: until the loop has run the flush of what was posted (at
        most `timeout_s`), so that it holds the GIL for the handlers' work instead of waiting
        for it."""
        self._taken.wait(timeout_s)

    def _flush(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
            self._scheduled = False
        for channel, event in items:
            channel.deliver(event)
        with self._lock:
            if not self._scheduled:  # no later post scheduled another flush meanwhile
                self._taken.set()


class ReqChannel:
    """An EventSink whose events the request's handler (on the loop) awaits."""

    def __init__(self, pump: EventPump) -> None:
        self.pump = pump
        self.closed = False  # the final event was put (scheduler thread)
        self._items: list[WorkerEvent] = []
        self._waiter: asyncio.Future | None = None

    def put(self, event: WorkerEvent) -> None:
        if self.closed:
            return
        if isinstance(event, _FINAL):
            self.closed = True
        self.pump.post(self, event)

    def hand_over(self) -> None:
        self.pump.hand_over()

    def deliver(self, event: WorkerEvent) -> None:
        """On the loop: queue the event and wake the handler."""
        self._items.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._items:
            self._waiter = self.pump.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def get_batch(self) -> list[WorkerEvent]:
        """Every event delivered since the last call (at least one), in order."""
        await self._wait()
        items, self._items = self._items, []
        return items

    async def get(self) -> WorkerEvent:
        """The next event (for handlers that expect exactly one)."""
        await self._wait()
        return self._items.pop(0)
