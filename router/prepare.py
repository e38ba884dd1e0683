"""Turn a client request into a validated `PreparedRequest`: tokens + SamplingParams.

Everything a client can get wrong is caught here, before any worker is touched, and raised as
`InvalidRequest` naming the field (OpenAI `param`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.served_tokenizer import fold_vocab, has_tokenizer_files
from pdserve.router.errors import InvalidRequest
from pdserve.router.registry import Registry


@dataclass
class PreparedRequest:
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    generated: int = 0  # output tokens at the end of input_ids (a continuation's)


def load_tokenizer(path: str, model_vocab_size: int | None = None) -> Any:
    """The model's tokenizer. HF dirs load directly (the router then never imports torch);
    anything else (a .gguf file) goes through the engine's loader. `model_vocab_size`: the
    vocabulary of a model with random weights, when larger than the tokenizer's (its extra ids
    decode folded, engine/served_tokenizer.py)."""
    if has_tokenizer_files(path):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    else:
        from pdserve.engine.loader import load_tokenizer as engine_load

        tok = engine_load(path)
    return fold_vocab(tok, model_vocab_size)


def eos_token_ids(tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _message_text(i: int, msg: Any) -> dict[str, str]:
    if not isinstance(msg, dict):
        raise InvalidRequest(f"messages[{i}]: must be an object", param="messages")
    role, content = msg.get("role"), msg.get("content")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise InvalidRequest(f"messages[{i}].role: unknown role {role!r}", param="messages")
    if content is None:
        content = ""
    if isinstance(content, list):  # content parts: only text is understood
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise InvalidRequest(
                    f"messages[{i}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise InvalidRequest(f"messages[{i}].content: must be a string", param="messages")
    return {"role": "system" if role == "developer" else role, "content": content}


class Preparer:
    """Tokenizes and validates against the tokenizer's vocab and the workers' context limit."""

    def __init__(self, tokenizer: Any, registry: Registry) -> None:
        self.tokenizer = tokenizer
        self.registry = registry
        self.vocab_size = len(tokenizer)

    def encode_text(self, text: str, param: str = "prompt") -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest(f"{param}: must be a string", param=param)
        if not text:
            raise InvalidRequest(f"{param}: must not be empty", param=param)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages: must be a non-empty list", param="messages")
        convo = [_message_text(i, m) for i, m in enumerate(messages)]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(convo, tokenize=False,
                                                      add_generation_prompt=True)
        else:  # a model without a template: plain "role: content" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in convo) + "assistant: "
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def warm_up(self) -> None:
        """Compile the chat template and run the encoders and the decoder once, so that the
        first requests do not pay for it (jinja compiles a template on first use)."""
        ids = self.encode_chat([{"role": "user", "content": "Hello"}])
        self.encode_text("Hello")
        self.tokenizer.decode(ids[-4:])

    def context_limit(self) -> int:
        """Smallest max_context_len among the workers in rotation (0 = unknown)."""
        limits = [w.max_context_len for w in self.registry.available("prefill", "decode", "mixed")
                  if w.max_context_len > 0]
        return min(limits, default=0)

    def build(self, input_ids: list[int], sampling: dict[str, Any], max_tokens: int | None,
              request_id: str | None = None, prompt_param: str = "prompt") -> PreparedRequest:
        """Validate; `max_tokens=None` means as many as fit (capped by default_max_tokens)."""
        if not input_ids:
            raise InvalidRequest(f"{prompt_param}: must not be empty", param=prompt_param)
        bad = _bad_ids(input_ids, self.vocab_size)
        if bad:
            raise InvalidRequest(
                f"{prompt_param}: token ids must be in [0, {self.vocab_size}) (vocab size), "
                f"got {bad[:5]}", param=prompt_param)
        prompt_len = len(input_ids)
        limit = self.context_limit()
        if limit and prompt_len >= limit:
            raise InvalidRequest(
                f"{prompt_param}: this model's maximum context length is {limit} tokens, but "
                f"the prompt has {prompt_len} tokens", param=prompt_param,
                code="context_length_exceeded")
        if max_tokens is None:
            cap = self.registry.config.default_max_tokens
            max_tokens = min(cap, limit - prompt_len) if limit else cap
        elif limit and isinstance(max_tokens, int) and prompt_len + max_tokens > limit:
            raise InvalidRequest(
                f"max_tokens: this model's maximum context length is {limit} tokens, but "
                f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion)", param="max_tokens",
                code="context_length_exceeded")
        try:
            params = SamplingParams.from_dict({**sampling, "max_tokens": max_tokens})
            params.validate(self.vocab_size)
        except (ValueError, TypeError) as e:
            raise InvalidRequest.from_value_error(ValueError(str(e))) from None
        rid = request_id or f"req-{uuid.uuid4().hex}"
        return PreparedRequest(request_id=rid, input_ids=list(input_ids), sampling=params)


def _bad_ids(ids: list, vocab_size: int) -> list:
    """The entries of `ids` that are not token ids in [0, vocab_size) (bools excluded). The
    common case, all ints in range, is settled by one pass over their types and min/max."""
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return []
    return [t for t in ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
