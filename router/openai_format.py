"""FlowEvents -> OpenAI response objects and stream chunks (completions and chat)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router.events import FlowEvent, TokenLogprob, Usage


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def completion_logprobs(lps: list[TokenLogprob], text_offset: int) -> dict:
    """Legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
    offsets, pos = [], text_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {"tokens": [lp.token for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t[1]: t[2] for t in lp.top} if lp.top else None for lp in lps],
            "text_offset": offsets}


def chat_logprobs(lps: list[TokenLogprob]) -> dict:
    return {"content": [
        {"token": lp.token, "logprob": lp.logprob, "bytes": _bytes(lp.token),
         "top_logprobs": [{"token": t[1], "logprob": t[2], "bytes": _bytes(t[1])}
                          for t in lp.top]}
        for lp in lps]}


def usage_dict(usages: list[Usage]) -> dict:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)}}


@dataclass
class ChoiceState:
    """Everything one choice produced (for non-streaming answers and the final usage)."""

    index: int
    counts_prompt: bool  # n > 1: the prompt is counted once, on the first of its choices
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: dict | None = None
    workers: tuple[str, str] = ("", "")
    disagg: dict | None = None
    emitted_chars: int = 0

    def add(self, event: FlowEvent) -> None:
        self.text.append(event.text)
        if event.logprobs:
            self.logprobs.extend(event.logprobs)
        if event.finish_reason:
            self.finish_reason = event.finish_reason
            self.timings = event.timings
            self.workers = (event.prefill_worker, event.decode_worker)
            self.disagg = event.disagg
            if event.usage is not None:
                self.usage = event.usage
                if not self.counts_prompt:
                    self.usage = Usage(0, event.usage.completion_tokens, 0)


def total_usage(choices: list[ChoiceState]) -> dict:
    return usage_dict([c.usage for c in choices if c.usage is not None])


def extras(choices: list[ChoiceState]) -> dict:
    """Non-OpenAI visibility: which workers served each choice and where the time went."""
    return {"choices": [{"index": c.index, "prefill_worker": c.workers[0],
                         "decode_worker": c.workers[1], "timings": c.timings,
                         "disaggregation": c.disagg} for c in choices]}


def completion_response(rid: str, created: int, model: str, choices: list[ChoiceState],
                        want_logprobs: bool) -> dict:
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        out.append({"index": c.index, "text": "".join(c.text),
                    "logprobs": completion_logprobs(c.logprobs, 0) if want_logprobs else None,
                    "finish_reason": c.finish_reason})
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": out, "usage": total_usage(choices), "pdserve": extras(choices)}


def chat_response(rid: str, created: int, model: str, choices: list[ChoiceState],
                  want_logprobs: bool) -> dict:
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        out.append({"index": c.index,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None,
                    "finish_reason": c.finish_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": out, "usage": total_usage(choices), "pdserve": extras(choices)}


def completion_chunk(rid: str, created: int, model: str, choice: ChoiceState,
                     event: FlowEvent, want_logprobs: bool) -> dict:
    lps = None
    if want_logprobs and event.logprobs:
        lps = completion_logprobs(event.logprobs, choice.emitted_chars)
    choice.emitted_chars += len(event.text)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": choice.index, "text": event.text, "logprobs": lps,
                         "finish_reason": event.finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               event: FlowEvent | None, want_logprobs: bool) -> dict:
    lps = None
    if want_logprobs and event is not None and event.logprobs:
        lps = chat_logprobs(event.logprobs)
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": lps,
                         "finish_reason": event.finish_reason if event is not None else None}]}


def usage_chunk(rid: str, created: int, model: str, obj: str,
                choices: list[ChoiceState]) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": total_usage(choices), "pdserve": extras(choices)}
