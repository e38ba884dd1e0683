"""A request's state inside a worker's scheduler.

KV ownership: the request's ReqToTokenPool row holds the slots of positions [0, kv_len).
Positions [0, prefix_len) belong to the radix cache (kept alive by lock_ref on `last_node`);
positions [prefix_len, kv_len) belong to the request until it releases them through
`RadixCache.cache_finished_req`.

Roles that need more per-request state subclass Req with typed fields (the offline engine's
text stream, the prefill side's KV sender, the decode side's receiver and event sink).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.sampling_params import SamplingParams


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    namespace: Hashable | None = None
    output_ids: list[int] = field(default_factory=list)
    # KV memory (see module docstring)
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_len: int = 0
    last_node: Any = None
    # reporting
    cached_tokens: int = 0  # prompt tokens served from the radix cache on first admission
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_retractions: int = 0
    admitted: bool = False
    # timings (perf_counter seconds)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    prefill_s: float = 0.0

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs before sampling its next token."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend_remaining(self) -> int:
        """Tokens of fill_ids still without KV (an extend batch computes them)."""
        return self.seq_len - self.kv_len
