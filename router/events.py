"""What the request flow hands to its front ends (gRPC Generate, the HTTP gateway)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.rpc import token_chunk


class AbortSignal:
    """A request's abort (Router.Abort, or the client went away): set once; what subscribed
    is called then, or at once when subscribing after it. Callbacks, not an asyncio.Event:
    waiting on an Event would take a task per request for its whole life."""

    __slots__ = ("_set", "_callbacks")

    def __init__(self) -> None:
        self._set = False
        self._callbacks: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    def subscribe(self, cb: Callable[[], None]) -> Callable[[], None]:
        """Call `cb` at set (now, if already set); returns what unsubscribes it."""
        if self._set:
            cb()
            return lambda: None
        self._callbacks.append(cb)
        return lambda: self._callbacks.remove(cb) if cb in self._callbacks else None


TIMING_FIELDS = ("queue_ms", "bootstrap_ms", "prefill_ms", "transfer_ms", "decode_ms", "ttft_ms")


@dataclass
class TokenLogprob:
    """One generated token's logprob and its top alternatives (token id, text, logprob)."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_proto(self) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.prompt_tokens,
                        completion_tokens=self.completion_tokens,
                        cached_tokens=self.cached_tokens)


@dataclass
class FlowEvent:
    """A piece of one request's output. The last event has `finish_reason` (and usage, timings),
    or `error` when the workers failed after output had already reached the client."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: dict[str, float] | None = None
    prefill_worker: str = ""
    decode_worker: str = ""
    error: str | None = None
    disagg: dict | None = None  # on the last event: DisaggDecision.to_json()

    def to_proto(self) -> pb.GenerateResponse:
        lps = self.logprobs or []
        top = [([t[0] for t in lp.top], [t[2] for t in lp.top]) for lp in lps] \
            if any(lp.top for lp in lps) else []
        chunk = token_chunk(self.token_ids, [lp.logprob for lp in lps], top)
        msg = pb.GenerateResponse(request_id=self.request_id, chunk=chunk, text=self.text,
                                  finish_reason=self.finish_reason or "",
                                  prefill_worker=self.prefill_worker,
                                  decode_worker=self.decode_worker)
        if self.usage is not None:
            msg.usage.CopyFrom(self.usage.to_proto())
        if self.timings is not None:
            msg.timings.CopyFrom(pb.StageTimings(**self.timings))
        return msg


def timings_to_dict(t: pb.StageTimings) -> dict[str, float]:
    return {name: getattr(t, name) for name in TIMING_FIELDS}


def merge_timings(*parts: dict[str, float]) -> dict[str, float]:
    """Sum stage by stage: each stage is filled by whoever measured it."""
    out = dict.fromkeys(TIMING_FIELDS, 0.0)
    for part in parts:
        for name in TIMING_FIELDS:
            out[name] += part.get(name, 0.0)
    return out
