"""OpenAI request bodies (completions, chat completions) and their sampling fields.

Types are strict (a string is not a number); unknown fields are ignored, as OpenAI does.
Unsupported features that would silently change results (echo, suffix, logit_bias, best_of > n,
tools) are refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pdserve.router.errors import InvalidRequest

MAX_N = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras (vLLM / SGLang names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    request_id: str | None = None

    def sampling(self, logprobs: int | None) -> dict[str, Any]:
        """SamplingParams fields the client set (max_tokens excluded: resolved per prompt)."""
        if self.logit_bias:
            raise InvalidRequest("logit_bias: not supported", param="logit_bias")
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n: must be in [1, {MAX_N}], got {self.n}", param="n")
        out: dict[str, Any] = {}
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                     "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
                     "skip_special_tokens"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.stop is not None:
            out["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids is not None:
            out["stop_token_ids"] = tuple(self.stop_token_ids)
        if logprobs is not None:
            out["logprobs"] = logprobs
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a (possibly batched) request, each text or token ids."""
        if self.echo:
            raise InvalidRequest("echo: not supported", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix: not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of: only best_of == n is supported", param="best_of")
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            return [[]]
        if len(p) * self.n > MAX_N:
            raise InvalidRequest(f"prompt: at most {MAX_N} prompts x n per request",
                                 param="prompt")
        return list(p)


class ChatCompletionRequest(_Common):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def logprobs_k(self) -> int | None:
        if self.tools:
            raise InvalidRequest("tools: not supported", param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs: requires logprobs to be true",
                                 param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise InvalidRequest("body: must be a JSON object", param=None)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = err.get("loc", ())
        param = str(loc[0]) if loc else None  # the top-level field; deeper parts are type tags
        where = param or "body"
        raise InvalidRequest(f"{where}: {err.get('msg', 'invalid value')}", param=param) from None
