"""RadixCache: page-aligned matching and splitting, namespaces, locks, LRU eviction, and the
request protocol (cache_finished_req / cache_unfinished_req) under the ownership invariant."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.allocator import PagedAllocator
from pdserve.engine.radix_cache import RadixCache

PS = 4


def make(num_pages: int = 32, disable: bool = False) -> tuple[PagedAllocator, RadixCache]:
    alloc = PagedAllocator(num_pages, PS)
    return alloc, RadixCache(alloc, PS, disable=disable)


def fresh(alloc: PagedAllocator, n: int) -> torch.Tensor:
    out = alloc.alloc_extend([0], [n], [-1])
    assert out is not None
    return out


def check_invariants(alloc: PagedAllocator, cache: RadixCache, owned: list[torch.Tensor]) -> None:
    """free + tree + request-owned pages == usable pages, pairwise disjoint; key lengths are
    page multiples; token counters match the tree."""
    tree_pages: list[int] = []
    evictable = protected = 0
    for node in cache.nodes():
        assert len(node.key) % PS == 0 and len(node.key) == node.value.numel() > 0
        tree_pages += (node.value[::PS] // PS).tolist()
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
    req_pages = [p for s in owned for p in set((s // PS).tolist())]
    free = alloc.free_page_ids().tolist()
    everything = tree_pages + req_pages + free
    assert len(everything) == len(set(everything)) == alloc.num_usable_pages, cache.pretty_print()
    assert (cache.evictable_tokens, cache.protected_tokens) == (evictable, protected)
    assert cache.total_cached_pages == len(tree_pages)


def test_match_after_insert_returns_inserted_slots_page_aligned() -> None:
    alloc, cache = make()
    ids = list(range(10))
    slots = fresh(alloc, 10)
    assert cache.insert(ids, slots) == 0
    alloc.free(slots[8:])  # the unaligned tail stays the caller's
    m = cache.match_prefix(ids)
    assert m.slots.tolist() == slots[:8].tolist() and m.prefix_len == 8
    assert cache.match_prefix(ids[:7]).slots.tolist() == slots[:4].tolist()
    assert cache.match_prefix([99] + ids).prefix_len == 0
    check_invariants(alloc, cache, [])


def test_insert_returns_present_len_and_splits_at_page_boundary() -> None:
    alloc, cache = make()
    a = list(range(12))
    sa = fresh(alloc, 12)
    cache.insert(a, sa)
    b = a[:6] + [77] * 6  # diverges inside the second page
    sb = fresh(alloc, 12)
    assert cache.insert(b, sb) == 4
    alloc.free(sb[:4])  # duplicate of the tree's first page
    lens = sorted(len(n.key) for n in cache.nodes())
    assert lens == [4, 8, 8]
    assert cache.match_prefix(b).slots.tolist() == sa[:4].tolist() + sb[4:].tolist()
    assert cache.match_prefix(a).slots.tolist() == sa.tolist()
    check_invariants(alloc, cache, [])


def test_match_splits_node_where_match_ends() -> None:
    alloc, cache = make()
    ids = list(range(16))
    cache.insert(ids, fresh(alloc, 16))
    assert len(list(cache.nodes())) == 1
    m = cache.match_prefix(ids[:9])
    assert m.prefix_len == 8 and len(m.last_node.key) == 8
    assert sorted(len(n.key) for n in cache.nodes()) == [8, 8]
    check_invariants(alloc, cache, [])


def test_namespaces_do_not_share() -> None:
    alloc, cache = make()
    ids = list(range(8))
    cache.insert(ids, fresh(alloc, 8), namespace="lora-a")
    assert cache.match_prefix(ids).prefix_len == 0
    assert cache.match_prefix(ids, namespace="lora-b").prefix_len == 0
    assert cache.insert(ids, fresh(alloc, 8), namespace="lora-b") == 0
    assert cache.match_prefix(ids, namespace="lora-a").prefix_len == 8
    check_invariants(alloc, cache, [])


def test_locked_nodes_survive_eviction_and_lru_order() -> None:
    alloc, cache = make()
    old, mid, new = [1] * 8, [2] * 8, [3] * 8
    for ids in (old, mid, new):
        cache.insert(ids, fresh(alloc, 8))
    cache.match_prefix(old)  # touch: `mid` is now least recently used
    locked = cache.match_prefix(new).last_node
    cache.inc_lock_ref(locked)
    assert cache.protected_tokens == 8 and cache.evictable_tokens == 16
    assert cache.evict(4) == 8  # whole node
    assert cache.match_prefix(mid).prefix_len == 0 and cache.match_prefix(old).prefix_len == 8
    assert cache.evict(100) == 8
    assert cache.match_prefix(new).prefix_len == 8 and cache.evictable_tokens == 0
    cache.dec_lock_ref(locked)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.dec_lock_ref(locked)
    assert cache.evict(100) == 8 and alloc.num_free_pages == alloc.num_usable_pages


def test_eviction_frees_parents_after_children() -> None:
    alloc, cache = make()
    cache.insert(list(range(8)), fresh(alloc, 8))
    shared = cache.match_prefix(list(range(4))).slots  # splits the first node
    assert cache.insert(list(range(4)) + [9] * 4, torch.cat([shared, fresh(alloc, 4)])) == 4
    assert len(list(cache.nodes())) == 3
    assert cache.evict(100) == 12
    assert alloc.num_free_pages == alloc.num_usable_pages and not list(cache.nodes())


def test_request_protocol_finished_and_unfinished() -> None:
    alloc, cache = make()
    prompt = list(range(11))
    # request A runs chunked prefill: chunk 1 = 6 tokens, then cache_unfinished_req.
    m = cache.match_prefix(prompt[:-1])
    cache.inc_lock_ref(m.last_node)
    a_slots = fresh(alloc, 6)
    a_slots, a_node, a_pre = cache.cache_unfinished_req(prompt[:6], a_slots, 0, m.last_node)
    assert a_pre == 4 and a_node.lock_ref == 1 and cache.protected_tokens == 4
    check_invariants(alloc, cache, [a_slots[a_pre:]])
    more = alloc.alloc_extend([6], [11], [int(a_slots[-1])])
    a_slots = torch.cat([a_slots, more])
    # request B with the same prompt arrives and borrows A's first page.
    mb = cache.match_prefix(prompt[:-1])
    assert mb.slots.tolist() == a_slots[:4].tolist()
    cache.inc_lock_ref(mb.last_node)
    b_slots = torch.cat([mb.slots, alloc.alloc_extend([4], [11], [-1])])
    check_invariants(alloc, cache, [a_slots[4:], b_slots[4:]])
    cache.cache_finished_req(prompt, a_slots, a_pre, a_node)
    check_invariants(alloc, cache, [b_slots[4:]])
    cache.cache_finished_req(prompt, b_slots, 4, mb.last_node)  # its pages 4..8 are duplicates
    check_invariants(alloc, cache, [])
    assert cache.protected_tokens == 0 and cache.evictable_tokens == 8
    assert cache.match_prefix(prompt).slots.tolist() == a_slots[:8].tolist()


def test_validation_errors() -> None:
    alloc, cache = make()
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(alloc, 8)
    with pytest.raises(ValueError, match="slots"):
        cache.insert([1, 2, 3, 4], fresh(alloc, 3))
    bad = fresh(alloc, 8)
    with pytest.raises(ValueError, match="slots"):
        cache.insert(list(range(8)), bad.flip(0))
    with pytest.raises(ValueError, match="prefix_len"):
        cache.cache_finished_req(list(range(8)), bad, 3, None)


def test_disabled_cache_needs_no_special_case() -> None:
    alloc, cache = make(disable=True)
    ids = list(range(10))
    m = cache.match_prefix(ids)
    assert m.prefix_len == 0
    cache.inc_lock_ref(m.last_node)
    slots = fresh(alloc, 10)
    slots2, node, pre = cache.cache_unfinished_req(ids, slots, 0, m.last_node)
    assert pre == 0 and slots2.tolist() == slots.tolist()
    cache.cache_finished_req(ids, slots2, pre, node)
    assert alloc.num_free_pages == alloc.num_usable_pages
    assert cache.insert(ids[:8], fresh(alloc, 8)) == 0
    assert alloc.num_free_pages == alloc.num_usable_pages and cache.evict(10) == 0


def test_reset_frees_everything_unless_locked() -> None:
    alloc, cache = make()
    cache.insert(list(range(8)), fresh(alloc, 8))
    node = cache.match_prefix(list(range(8))).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.num_free_pages == alloc.num_usable_pages and cache.total_cached_pages == 0
    assert "RadixCache" in cache.pretty_print()
