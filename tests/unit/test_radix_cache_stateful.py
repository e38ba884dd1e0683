"""Stateful property test: requests admitted, extended (chunked prefill and decode), cached,
finished, with eviction under memory pressure, against a simulated KV pool.

Each slot's simulated KV records (token, position); a slot the tree or a request hands out
must always hold the KV of the token it stands for, which catches any page that is owned
twice, freed while in use, or matched to the wrong prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.allocator import PagedAllocator
from pdserve.engine.radix_cache import RadixCache
from pdserve.engine.radix_node import TreeNode

PS = 4
NUM_PAGES = 40
BASES = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 1, 0, 0, 1, 1] * 2,
         [2] * 16]


def encode(ids: list[int], start: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64) * 1000 + torch.arange(start, start + len(ids))


@dataclass
class SimReq:
    ids: list[int]
    namespace: str | None
    slots: torch.Tensor  # KV slots of ids[:kv_len]
    prefix_len: int  # borrowed from the tree
    last_node: TreeNode

    @property
    def kv_len(self) -> int:
        return self.slots.numel()


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PagedAllocator(NUM_PAGES, PS)
        self.cache = RadixCache(self.alloc, PS)
        self.kv = torch.full((NUM_PAGES * PS,), -1, dtype=torch.int64)
        self.reqs: list[SimReq] = []

    def _alloc(self, fn, *args) -> torch.Tensor | None:
        out = fn(*args)
        if out is None:
            self.cache.evict(self.alloc.page_size * 8)
            out = fn(*args)
        return out

    @precondition(lambda self: len(self.reqs) < 5)
    @rule(base=st.integers(0, 2), keep=st.integers(0, 16),
          suffix=st.lists(st.integers(0, 3), max_size=10), ns=st.sampled_from([None, "b"]))
    def admit(self, base: int, keep: int, suffix: list[int], ns: str | None) -> None:
        ids = BASES[base][:keep] + suffix
        if not ids:
            return
        m = self.cache.match_prefix(ids[:-1], ns)
        assert m.prefix_len % PS == 0 and m.prefix_len < len(ids)
        self.cache.inc_lock_ref(m.last_node)
        self.reqs.append(SimReq(ids, ns, m.slots, m.prefix_len, m.last_node))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 4), n=st.integers(1, 9), token=st.integers(0, 3))
    def extend(self, i: int, n: int, token: int) -> None:
        r = self.reqs[i % len(self.reqs)]
        last = int(r.slots[-1]) if r.kv_len else -1
        if r.kv_len < len(r.ids):  # prefill chunk
            end = min(len(r.ids), r.kv_len + n)
            new = self._alloc(self.alloc.alloc_extend, [r.kv_len], [end], [last])
        else:  # decode one token
            new = self._alloc(self.alloc.alloc_decode, [r.kv_len + 1], [last])
            if new is not None:
                r.ids.append(token)
        if new is None:
            return
        self.kv[new] = encode(r.ids[r.kv_len:r.kv_len + new.numel()], r.kv_len)
        r.slots = torch.cat([r.slots, new])

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 4))
    def cache_unfinished(self, i: int) -> None:
        r = self.reqs[i % len(self.reqs)]
        r.slots, r.last_node, r.prefix_len = self.cache.cache_unfinished_req(
            r.ids[:r.kv_len], r.slots, r.prefix_len, r.last_node, r.namespace)
        assert r.prefix_len == r.kv_len // PS * PS

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 4))
    def finish(self, i: int) -> None:
        r = self.reqs.pop(i % len(self.reqs))
        self.cache.cache_finished_req(r.ids[:r.kv_len], r.slots, r.prefix_len, r.last_node,
                                      r.namespace)

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        before = self.alloc.num_free_pages
        freed = self.cache.evict(n)
        assert freed % PS == 0 and self.alloc.num_free_pages - before == freed // PS
        assert freed >= n or self.cache.evictable_tokens == 0

    @rule(base=st.integers(0, 2), keep=st.integers(0, 16), ns=st.sampled_from([None, "b"]))
    def probe(self, base: int, keep: int, ns: str | None) -> None:
        ids = BASES[base][:keep]
        m = self.cache.match_prefix(ids, ns)
        assert torch.equal(self.kv[m.slots], encode(ids[:m.prefix_len], 0))

    @invariant()
    def pages_partitioned(self) -> None:
        tree_pages: list[int] = []
        expected_locks: dict[int, int] = {}
        for r in self.reqs:
            node: TreeNode | None = r.last_node
            while node is not None and not node.is_root:
                expected_locks[node.node_id] = expected_locks.get(node.node_id, 0) + 1
                node = node.parent
        stack = [(root, 0) for root in self.cache._roots.values()]
        while stack:
            node, depth = stack.pop()
            if not node.is_root:
                assert len(node.key) % PS == 0 and len(node.key) > 0
                assert node.lock_ref == expected_locks.get(node.node_id, 0)
                assert torch.equal(self.kv[node.value], encode(node.key, depth))
                tree_pages += (node.value[::PS] // PS).tolist()
            stack.extend((c, depth + len(node.key)) for c in node.children.values())
        req_pages = [p for r in self.reqs for p in set((r.slots[r.prefix_len:] // PS).tolist())]
        free = self.alloc.free_page_ids().tolist()
        everything = tree_pages + req_pages + free
        assert len(everything) == len(set(everything)) == NUM_PAGES - 1, self.cache.pretty_print()
        for r in self.reqs:
            assert set((r.slots[:r.prefix_len] // PS).tolist()) <= set(tree_pages)
            assert torch.equal(self.kv[r.slots], encode(r.ids[:r.kv_len], 0))


CacheMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40,
                                          deadline=None)
TestCacheMachine = CacheMachine.TestCase
