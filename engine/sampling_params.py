"""Per-request sampling parameters, their validation and their wire form.

The same `SamplingParams` travels router -> prefill and router -> decode (as a dict on the
wire), so both workers sample and stop under identical rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy: dividing by them overflows the logits.
GREEDY_TEMPERATURE = 1e-5


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    `temperature == 0` means greedy; `top_k` of -1 or 0 and `top_p == 1` and `min_p == 0` turn
    those filters off. `logprobs=None` returns no logprobs, `0` the chosen token's, `k` also the
    top-k. `stop` strings are not included in the output text (OpenAI semantics).
    Construction validates everything that does not depend on the vocabulary;
    `validate(vocab_size)` adds the token-id range checks.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists (JSON) and a bare string for `stop` (OpenAI allows it); store tuples.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if isinstance(stop, list):
            stop = tuple(stop)
        object.__setattr__(self, "stop", stop)
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first invalid field and its allowed range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_range("temperature", self.temperature, lo=0.0)
        _check_range("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (off) or >= 1, got {self.top_k!r}")
        _check_range("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed: must be an integer or None, got {self.seed!r}")
        _check_range("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _check_range("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_range("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        if not isinstance(self.stop, tuple) or not all(
                isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids: must be a list of integers >= 0, got {self.stop_token_ids!r}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"stop_token_ids: must be in [0, {vocab_size}) (vocab size), got {bad}")
        if not _is_bool(self.ignore_eos):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (
                not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(
                f"logprobs: must be None or an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.logprobs!r}")
        if not _is_bool(self.skip_special_tokens):
            raise ValueError(
                f"skip_special_tokens: must be a bool, got {self.skip_special_tokens!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a wire dict; unknown keys raise ValueError naming them."""
        if not hasattr(d, "keys"):
            raise ValueError(f"sampling_params: must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Wire form: JSON-safe (tuples become lists); `from_dict(to_dict())` round-trips."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


def _check_range(name: str, value: Any, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    if not _is_number(value):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        op = ">" if lo_open else ">="
        rng = f"must be {op} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
        raise ValueError(f"{name}: {rng}, got {value!r}")
    if hi is not None and value > hi:
        op = ">" if lo_open else ">="
        rng = (f"must be {op} {lo:g} and " if lo is not None else "must be ") + f"<= {hi:g}"
        raise ValueError(f"{name}: {rng}, got {value!r}")
