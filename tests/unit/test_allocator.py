"""PagedAllocator: page 0 reserved, all-or-nothing allocation, page alignment, double free."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.allocator import PagedAllocator


def check_extend_layout(ps: int, pre: int, seq: int, last_loc: int, slots: list[int],
                        fresh_pages: set[int]) -> set[int]:
    """Token j sits at offset j % ps; tokens of one page share a page; a page boundary is the
    only place a new (previously free) page starts. Returns the new pages used."""
    used: dict[int, int] = {}  # token page index -> pool page
    if pre % ps:
        used[(pre - 1) // ps] = last_loc // ps
    new_pages = set()
    for j, slot in zip(range(pre, seq), slots):
        assert slot % ps == j % ps
        page = slot // ps
        if j // ps in used:
            assert used[j // ps] == page
        else:
            assert j % ps == 0 or j == pre and pre % ps == 0
            assert page in fresh_pages and page not in new_pages
            used[j // ps] = page
            new_pages.add(page)
    return new_pages


def test_page_zero_never_allocated_and_exhaustion() -> None:
    alloc = PagedAllocator(9, 4)
    assert alloc.num_free_pages == 8 and alloc.available_tokens == 32
    pages = alloc.alloc_pages(8)
    assert pages is not None and sorted(pages.tolist()) == list(range(1, 9))
    assert alloc.alloc_pages(1) is None
    assert alloc.alloc_extend([0], [1], [-1]) is None
    assert alloc.alloc_decode([1], [-1]) is None
    alloc.free_pages(pages)
    assert alloc.num_free_pages == 8 and alloc.num_used_pages == 0


def test_short_allocation_takes_nothing() -> None:
    alloc = PagedAllocator(5, 4)  # 4 usable pages
    assert alloc.alloc_extend([0, 0], [8, 9], [-1, -1]) is None  # needs 5
    assert alloc.num_free_pages == 4
    assert alloc.alloc_pages(5) is None and alloc.num_free_pages == 4


def test_alloc_extend_continues_partial_page_then_boundaries() -> None:
    ps = 4
    alloc = PagedAllocator(16, ps)
    first = alloc.alloc_extend([0], [6], [-1])
    assert first is not None and first.dtype == torch.int64
    pages = (first // ps).tolist()
    assert pages[:4] == [pages[0]] * 4 and pages[4:] == [pages[4]] * 2 and pages[0] != pages[4]
    free_before = set(alloc.free_page_ids().tolist())
    more = alloc.alloc_extend([6], [13], [int(first[-1])])
    assert more is not None
    assert more[:2].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]  # fills page of token 5
    check_extend_layout(ps, 6, 13, int(first[-1]), more.tolist(), free_before)
    assert alloc.num_free_pages == 15 - 4


def test_alloc_decode_new_page_only_at_boundary() -> None:
    ps = 4
    alloc = PagedAllocator(8, ps)
    slots = alloc.alloc_extend([0, 0], [4, 3], [-1, -1])
    assert slots is not None
    last_a, last_b = int(slots[3]), int(slots[-1])
    free = alloc.num_free_pages
    out = alloc.alloc_decode([5, 4], [last_a, last_b])
    assert out is not None
    assert out[1] == last_b + 1 and out[0] % ps == 0 and out[0] // ps != last_a // ps
    assert alloc.num_free_pages == free - 1


def test_bad_last_loc_and_lengths_raise() -> None:
    alloc = PagedAllocator(8, 4)
    with pytest.raises(ValueError, match="last_locs"):
        alloc.alloc_extend([5], [7], [4 * 2 + 3])  # token 4 must sit at offset 0
    with pytest.raises(ValueError, match="seq_lens"):
        alloc.alloc_extend([5], [4], [8])
    with pytest.raises(ValueError, match="last_locs"):
        alloc.alloc_decode([3], [4 * 2 + 3])
    with pytest.raises(ValueError, match="seq_lens"):
        alloc.alloc_extend([0, 0], [1], [-1, -1])
    assert alloc.num_free_pages == 7


def test_double_free_raises_with_page_id() -> None:
    alloc = PagedAllocator(8, 4)
    slots = alloc.alloc_extend([0], [6], [-1])
    assert slots is not None
    alloc.free(slots)  # two slots per page is fine: distinct pages are freed once
    page = int(slots[0]) // 4
    with pytest.raises(RuntimeError, match=str(page)):
        alloc.free(slots[:1])
    pages = alloc.alloc_pages(2)
    assert pages is not None
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free_pages([int(pages[0]), int(pages[0])])
    with pytest.raises(ValueError, match="pages"):
        alloc.free_pages([0])
    alloc.free_pages(pages)
    assert alloc.num_free_pages == 7


def test_freed_pages_are_reused_in_order() -> None:
    alloc = PagedAllocator(6, 2)
    a = alloc.alloc_pages(5)
    assert a is not None
    alloc.free_pages([4, 2])
    alloc.free_pages([3])
    assert alloc.alloc_pages(3).tolist() == [2, 3, 4]  # merged and sorted: consecutive runs


@settings(max_examples=60, deadline=None)
@given(ps=st.sampled_from([1, 2, 4, 8]), ops=st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(1, 9)), max_size=40))
def test_random_ops_keep_free_plus_owned_equal_total(
        ps: int, ops: list[tuple[int, int, int]]) -> None:
    num_pages = 24
    alloc = PagedAllocator(num_pages, ps)
    reqs: list[list[int]] = []  # each live request's slots, position order
    for kind, n, batch in ops:
        free_before = set(alloc.free_page_ids().tolist())
        if kind == 0:  # new requests
            lens = [(n * (i + 1)) % 17 for i in range(batch % 3 + 1)]
            out = alloc.alloc_extend([0] * len(lens), lens, [-1] * len(lens))
            if out is not None:
                for seq_len, part in zip(lens, out.split(lens)):
                    check_extend_layout(ps, 0, seq_len, -1, part.tolist(), free_before)
                    reqs.append(part.tolist())
        elif kind == 1 and reqs:  # extend a batch of existing requests
            chosen = reqs[: batch % 3 + 1]
            pre = [len(r) for r in chosen]
            seq = [p + (n + i) % 11 for i, p in enumerate(pre)]
            last = [r[-1] if r else -1 for r in chosen]
            out = alloc.alloc_extend(pre, seq, last)
            if out is not None:
                new_pages: set[int] = set()
                for r, p, s, part in zip(chosen, pre, seq, out.split([s - p for p, s in
                                                                       zip(pre, seq)])):
                    got = check_extend_layout(ps, p, s, r[-1] if r else -1, part.tolist(),
                                              free_before)
                    assert not got & new_pages
                    new_pages |= got
                    r.extend(part.tolist())
        elif kind == 2 and reqs:  # decode step
            chosen = [r for r in reqs if r][: batch]
            out = alloc.alloc_decode([len(r) + 1 for r in chosen], [r[-1] for r in chosen])
            if out is not None:
                for r, s in zip(chosen, out.tolist()):
                    check_extend_layout(ps, len(r), len(r) + 1, r[-1], [s], free_before)
                    r.append(s)
        elif kind == 3 and reqs:  # finish one
            alloc.free(torch.tensor(reqs.pop(n % len(reqs)), dtype=torch.int64))
        owned = [s // ps for r in reqs for s in r]
        owned_pages = set(owned)
        free = set(alloc.free_page_ids().tolist())
        assert 0 not in owned_pages and 0 not in free
        assert not owned_pages & free
        assert len(owned_pages) + len(free) == num_pages - 1 == (
            alloc.num_free_pages + alloc.num_used_pages)
        assert alloc.num_free_pages == len(free)
        per_req = [{s // ps for s in r} for r in reqs]
        assert sum(len(p) for p in per_req) == len(owned_pages)  # no page shared by two


@settings(max_examples=60, deadline=None)
@given(ps=st.sampled_from([1, 4, 16]), pages_pre=st.integers(0, 5), n=st.integers(0, 70),
       taken=st.integers(0, 6))
def test_one_aligned_request_takes_the_pages_the_general_plan_takes(ps, pages_pre, n, taken):
    """A single request whose prefix ends on a page boundary takes a shortcut; it must place
    the tokens where the general plan (two requests, the second empty) does."""
    fast, plan = PagedAllocator(24, ps), PagedAllocator(24, ps)
    for alloc in (fast, plan):  # the same free list in both
        alloc.alloc_pages(taken)
    pre = pages_pre * ps
    got = fast.alloc_extend([pre], [pre + n], [-1])
    want = plan.alloc_extend([pre, 0], [pre + n, 0], [-1, -1])
    if want is None:
        assert got is None and fast.num_free_pages == plan.num_free_pages
        return
    assert got is not None and got.tolist() == want.tolist() and got.dtype == torch.int64
    assert fast.num_free_pages == plan.num_free_pages
    check_extend_layout(ps, pre, pre + n, -1, got.tolist(),
                        set(range(1, 24)) - set(range(1, taken + 1)))
