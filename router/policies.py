"""Routing policies: which prefill worker and which decode worker serve a request.

Policies see only the candidates the registry offers (healthy, not draining) and keep their own
per-instance state (round-robin cursors, the cache-aware prefix index); nothing is global.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from pdserve.router.config import RouterConfig
from pdserve.router.registry import WorkerEntry


class Policy(Protocol):
    name: str

    def pick(self, workers: Sequence[WorkerEntry], input_ids: Sequence[int]) -> WorkerEntry:
        """Pick one of `workers` (never empty) for a prompt."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def pick(self, workers: Sequence[WorkerEntry], input_ids: Sequence[int]) -> WorkerEntry:
        worker = workers[self._cursor % len(workers)]
        self._cursor += 1
        return worker


class LeastLoad:
    """Prefill: the worker with the fewest requests (ties: round-robin among the least)."""

    name = "least_load"

    def __init__(self) -> None:
        self._rr = RoundRobin()

    def pick(self, workers: Sequence[WorkerEntry], input_ids: Sequence[int]) -> WorkerEntry:
        low = min(w.load_score for w in workers)
        return self._rr.pick([w for w in workers if w.load_score == low], input_ids)


class PowerOfTwo:
    """Decode least load: sample two workers, take the less loaded (cheap, avoids herding)."""

    name = "least_load"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, workers: Sequence[WorkerEntry], input_ids: Sequence[int]) -> WorkerEntry:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if a.load_score <= b.load_score else b


class PrefixIndex:
    """Approximate record of the prompts one worker prefilled recently.

    Prompts are cut into blocks of `block_len` tokens; block i is keyed by a hash chained over
    blocks 0..i, so a hit on block i means the whole prefix up to it matched (as in a radix
    tree keyed by pages). LRU-bounded: old prefixes are forgotten as the worker's cache would.
    """

    def __init__(self, block_len: int, max_blocks: int) -> None:
        self.block_len = block_len
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def keys(self, input_ids: Sequence[int]) -> list[int]:
        out, h = [], 0
        for start in range(0, len(input_ids) - self.block_len + 1, self.block_len):
            h = hash((h, tuple(input_ids[start:start + self.block_len])))
            out.append(h)
        return out

    def match_len(self, keys: Sequence[int]) -> int:
        """Tokens of the prompt's prefix that this worker has (probably) cached."""
        n = 0
        for k in keys:
            if k not in self._blocks:
                break
            n += 1
        return n * self.block_len

    def insert(self, keys: Sequence[int]) -> None:
        for k in keys:
            self._blocks[k] = None
            self._blocks.move_to_end(k)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


class CacheAware:
    """Prefill prefix affinity with a load-balance escape hatch.

    Send a prompt to the worker that most recently prefilled its longest prefix, as long as
    that covers `min_match` of the prompt and the pool is balanced. When the busiest worker has
    more than `balance_abs` requests over the idlest and more than `balance_rel` times its load,
    or no worker matches enough, fall back to least load. The chosen worker learns the prompt.
    """

    name = "cache_aware"

    def __init__(self, balance_abs: int = 8, balance_rel: float = 1.5, min_match: float = 0.5,
                 block_len: int = 16, max_blocks: int = 65536) -> None:
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.min_match = min_match
        self.block_len = block_len
        self.max_blocks = max_blocks
        self._indexes: dict[str, PrefixIndex] = {}
        self._least = LeastLoad()

    def _index(self, worker: WorkerEntry) -> PrefixIndex:
        if worker.worker_id not in self._indexes:
            self._indexes[worker.worker_id] = PrefixIndex(self.block_len, self.max_blocks)
        return self._indexes[worker.worker_id]

    def pick(self, workers: Sequence[WorkerEntry], input_ids: Sequence[int]) -> WorkerEntry:
        live = {w.worker_id for w in workers}
        for wid in [w for w in self._indexes if w not in live]:
            del self._indexes[wid]  # a worker that left (or restarted) lost its cache
        keys = PrefixIndex(self.block_len, 0).keys(input_ids)
        loads = [w.load_score for w in workers]
        imbalanced = (max(loads) - min(loads) > self.balance_abs
                      and max(loads) > self.balance_rel * min(loads))
        chosen: WorkerEntry | None = None
        if not imbalanced and keys:
            best = max(workers, key=lambda w: (self._index(w).match_len(keys), -w.load_score))
            if self._index(best).match_len(keys) >= self.min_match * len(input_ids):
                chosen = best
        if chosen is None:
            chosen = self._least.pick(workers, input_ids)
        self._index(chosen).insert(keys)
        return chosen


def make_prefill_policy(config: RouterConfig) -> Policy:
    if config.prefill_policy == "round_robin":
        return RoundRobin()
    if config.prefill_policy == "least_load":
        return LeastLoad()
    return CacheAware(config.cache_aware_balance_abs, config.cache_aware_balance_rel,
                      config.cache_aware_min_match)


def make_decode_policy(config: RouterConfig) -> Policy:
    if config.decode_policy == "round_robin":
        return RoundRobin()
    return PowerOfTwo()
