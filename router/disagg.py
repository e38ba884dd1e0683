"""Conditional disaggregation: prefill remotely only when the uncached prompt is long enough.

Shipping KV pages costs a round trip, a bootstrap and a transfer; for a short uncached prompt
the decode worker prefills it faster itself (its own extend path, an empty `bootstrap_addr`).
The router decides per request and records why, so users can see it (the `pdserve` field of
responses, the `pdserve_router_disagg_decisions` metric):

- `threshold == 0` (default): always disaggregate when a prefill worker is available.
- otherwise disaggregate iff `uncached_len >= threshold`, where `uncached_len` is the prompt
  minus the prefix the chosen decode worker probably has cached from prompts it prefilled
  itself (an approximate per-worker prefix index, like the cache-aware policy's).
- no prefill worker in rotation: local prefill on a decode worker when
  `local_prefill_fallback` is on, else the request fails with 503.
With SLOs set, router/slo_dispatch.py reviews the decision against the workers' load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.router.policies import PrefixIndex
from pdserve.router.registry import WorkerEntry

REASONS = ("always", "long_prompt", "short_prompt", "no_prefill_worker", "mixed_worker",
           "prefill_busy", "decode_busy")  # the last two: router/slo_dispatch.py


@dataclass(frozen=True)
class DisaggDecision:
    """Why a request was (not) disaggregated."""

    disaggregated: bool
    reason: str  # one of REASONS
    prompt_len: int
    uncached_len: int
    threshold: int
    slo: dict | None = None  # the SLO dispatcher's estimates (ms), when it reviewed this

    def to_json(self) -> dict:
        out = {"disaggregated": self.disaggregated, "reason": self.reason,
               "prompt_len": self.prompt_len, "uncached_len": self.uncached_len,
               "threshold": self.threshold}
        if self.slo is not None:
            out["slo"] = {k: None if v is None else round(v, 3) for k, v in self.slo.items()}
        return out


class DisaggPolicy:
    """Decides remote vs local prefill; learns what each decode worker prefilled locally."""

    def __init__(self, threshold: int, block_len: int = 16, max_blocks: int = 65536) -> None:
        self.threshold = threshold
        self.block_len = block_len
        self.max_blocks = max_blocks
        self._indexes: dict[str, PrefixIndex] = {}

    def _index(self, worker: WorkerEntry) -> PrefixIndex:
        if worker.worker_id not in self._indexes:
            self._indexes[worker.worker_id] = PrefixIndex(self.block_len, self.max_blocks)
        return self._indexes[worker.worker_id]

    def forget_except(self, live: Sequence[WorkerEntry]) -> None:
        keep = {w.worker_id for w in live}
        for wid in [w for w in self._indexes if w not in keep]:
            del self._indexes[wid]

    def decide(self, input_ids: Sequence[int], decode: WorkerEntry, have_prefill: bool,
               local_fallback: bool,
               review: Callable[[DisaggDecision], DisaggDecision] | None = None
               ) -> DisaggDecision | None:
        """The decision for `decode`; None when the request cannot be served (no prefill
        worker and no fallback). `review` may change it (the SLO dispatcher) before `decode`
        learns that it prefills the prompt itself."""
        n = len(input_ids)
        keys: list[int] | None = None
        decision: DisaggDecision | None = None
        if self.threshold <= 0:
            uncached = n
            if have_prefill:
                decision = DisaggDecision(True, "always", n, n, 0)
        else:
            keys = PrefixIndex(self.block_len, 0).keys(input_ids)
            uncached = n - min(n, self._index(decode).match_len(keys))
            if have_prefill:
                long = uncached >= self.threshold
                decision = DisaggDecision(long, "long_prompt" if long else "short_prompt", n,
                                          uncached, self.threshold)
        if decision is None:
            if not local_fallback:
                return None
            decision = DisaggDecision(False, "no_prefill_worker", n, uncached, self.threshold)
        if review is not None:
            decision = review(decision)
        if not decision.disaggregated:
            self._index(decode).insert(
                keys if keys is not None else PrefixIndex(self.block_len, 0).keys(input_ids))
        return decision

    @staticmethod
    def mixed(input_ids: Sequence[int], threshold: int) -> DisaggDecision:
        n = len(input_ids)
        return DisaggDecision(False, "mixed_worker", n, n, threshold)
