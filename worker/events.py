"""What a scheduler tells a request's RPC handler, and the channel that carries it.

The scheduler thread produces typed events for one request; the request's asyncio handler
consumes them. A request's events end with exactly one FinishEvent, PrefilledEvent (prefill
worker: the first token is sampled and the last KV chunk queued) or ErrorEvent; the channel
drops anything put after that.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.req import Req


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
    """Prefill worker: the prompt is in KV, the first token sampled (it travels to decode in the
    aux data) and the last KV chunk queued."""

    cached_tokens: int
    finish_reason: str
    timings: StageTimes


@dataclass(frozen=True)
class ErrorEvent:
    message: str


WorkerEvent = TokensEvent | FinishEvent | PrefilledEvent | ErrorEvent
_FINAL = (FinishEvent, PrefilledEvent, ErrorEvent)


class EventSink(Protocol):
    """What a scheduler needs from a request's handler: somewhere to put its events. Called on
    the scheduler thread; must not block."""

    def put(self, event: WorkerEvent) -> None: ...


class ReqChannel:
    """An EventSink feeding an asyncio.Queue that the request's handler owns."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[WorkerEvent] = asyncio.Queue()
        self.closed = False

    def put(self, event: WorkerEvent) -> None:
        if self.closed:
            return
        if isinstance(event, _FINAL):
            self.closed = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    async def get(self) -> WorkerEvent:
        return await self.queue.get()
