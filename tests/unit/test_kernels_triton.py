"""Triton kernels against their torch references, under TRITON_INTERPRET=1 on CPU.

On a CUDA machine the same tests run compiled on the GPU (tests/gpu adds bf16 and larger
shapes). The interpreter flag must be set before any `triton.jit` runs, hence before the
kernel modules are imported.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pdserve.kernels import page_copy
from pdserve.kernels.attention_reference import (
    decode_attention_reference,
    extend_attention_reference,
)
from pdserve.kernels.decode_attention import decode_attention
from pdserve.kernels.decode_worklist import decode_attention_worklist, decode_plan
from pdserve.kernels.extend_attention import extend_attention
from pdserve.kernels.kv_store import store_kv, store_kv_reference
from pdserve.kernels.page_copy_triton import gather_pages, scatter_pages

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-2 if DEV == "cuda" else 2e-5  # fp32 tl.dot runs in tf32 on GPUs
LAYERS, PAGE = 3, 4


def _pool(num_pages: int, kv_heads: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, LAYERS, 2, PAGE, kv_heads, d, generator=g).to(DEV)


def _paged_seqs(seq_lens: list[int], num_pages: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Shuffled page-aligned slots per sequence -> (kv_indptr, kv_indices) on DEV."""
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    slots, used = [], 0
    for n in seq_lens:
        pages = perm[used:used + -(-n // PAGE)]
        used += len(pages)
        pos = torch.arange(n)
        slots.append(torch.tensor(pages, dtype=torch.int64)[pos // PAGE] * PAGE + pos % PAGE)
    indptr = torch.tensor([0, *torch.cumsum(torch.tensor(seq_lens), 0).tolist()])
    return indptr.to(DEV), torch.cat(slots).to(DEV)


def test_store_kv_matches_reference() -> None:
    pool = _pool(9, 2, 8, 0)
    ref = pool.clone()
    g = torch.Generator().manual_seed(1)
    slots = (torch.randperm(8 * PAGE, generator=g)[:11] + PAGE).to(DEV)
    qkv = torch.randn(11, 3, 2, 8, generator=g).to(DEV)  # strided k/v, as from a fused qkv
    k, v = qkv[:, 1], qkv[:, 2]
    store_kv(pool[:, 1, 0], pool[:, 1, 1], slots, k, v)
    store_kv_reference(ref[:, 1, 0], ref[:, 1, 1], slots, k, v)
    assert torch.equal(pool, ref)


def test_store_kv_rejects_bad_shape() -> None:
    pool = _pool(3, 2, 8, 0)
    with pytest.raises(ValueError, match="k:"):
        store_kv(pool[:, 0, 0], pool[:, 0, 1], torch.tensor([4], device=DEV),
                 torch.zeros(1, 3, 8, device=DEV), torch.zeros(1, 3, 8, device=DEV))


@pytest.mark.parametrize("pages", [[3, 4, 5, 9], [7, 1, 8, 2, 2], [], [6]])
def test_page_gather_scatter_match_reference(pages: list[int]) -> None:
    pool = _pool(10, 2, 8, 2)
    out = torch.zeros(6, *pool.shape[1:], device=DEV)
    ref = torch.zeros_like(out)
    gather_pages(pool, pages, out)
    page_copy.gather_pages(pool, pages, ref)
    assert torch.equal(out, ref)
    staging = torch.randn(len(pages), *pool.shape[1:]).to(DEV)
    a, b = pool.clone(), pool.clone()
    uniq = list(dict.fromkeys(pages))  # duplicate destinations have no defined winner
    scatter_pages(staging[:len(uniq)], a, torch.tensor(uniq, dtype=torch.int64))
    page_copy.scatter_pages(staging[:len(uniq)], b, uniq)
    assert torch.equal(a, b)


def test_page_copy_rejects_mismatch() -> None:
    pool = _pool(4, 2, 8, 0)
    with pytest.raises(ValueError, match="out"):
        gather_pages(pool, [1, 2], torch.zeros(1, *pool.shape[1:], device=DEV))
    with pytest.raises(ValueError, match="staging"):
        scatter_pages(torch.zeros(2, *pool.shape[1:], device=DEV, dtype=torch.float64),
                      pool, [1, 2])


@pytest.mark.parametrize("heads,kv_heads,splits,early_v,block_n", [
    (4, 4, 1, False, 64), (8, 2, 4, False, 64), (6, 1, 3, False, 64), (4, 2, 32, False, 64),
    (8, 2, 4, True, 64), (8, 2, 8, False, 16)])
def test_decode_attention_matches_reference(heads: int, kv_heads: int, splits: int,
                                            early_v: bool, block_n: int) -> None:
    d, seq_lens = 16, [1, 7, 33, 70, 4]
    num_pages = 1 + sum(-(-n // PAGE) for n in seq_lens) + 3
    pool = _pool(num_pages, kv_heads, d, 3)
    indptr, indices = _paged_seqs(seq_lens, num_pages, 4)
    q = torch.randn(len(seq_lens), heads, d, generator=torch.Generator().manual_seed(5)).to(DEV)
    kc, vc = pool[:, 2, 0], pool[:, 2, 1]
    out = decode_attention(q, kc, vc, indptr, indices, d**-0.5, num_splits=splits,
                           early_v=early_v, block_n=block_n)
    want = decode_attention_reference(q, kc, vc, indptr, indices, d**-0.5)
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("target,block_n,choices", [(2, 32, {}),
                                                   (4, 128, dict(early_v=False, num_stages=1)),
                                                   (40, 16, dict(num_warps=8))])
def test_decode_worklist_matches_reference(target: int, block_n: int, choices: dict) -> None:
    d, seq_lens, heads, kv_heads = 16, [3, 40, 129, 16], 8, 2
    num_pages = 1 + sum(-(-n // PAGE) for n in seq_lens) + 2
    pool = _pool(num_pages, kv_heads, d, 3)
    indptr, indices = _paged_seqs(seq_lens, num_pages, 6)
    q = torch.randn(len(seq_lens), heads, d, generator=torch.Generator().manual_seed(8)).to(DEV)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    plan = decode_plan(indptr, len(seq_lens), target, block_n)
    out = decode_attention_worklist(q, kc, vc, indptr, indices, d**-0.5, plan, **choices)
    want = decode_attention_reference(q, kc, vc, indptr, indices, d**-0.5)
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("seq_lens,target,block_n", [([1, 300, 2, 17, 64], 4, 16),
                                                    ([5], 1, 16), ([64, 64, 64], 3, 64),
                                                    ([1, 1, 1, 1000], 10, 32),
                                                    ([40, 33, 1, 900, 7], 6, 16)])
def test_decode_plan_cuts_equal_chunks(seq_lens: list[int], target: int, block_n: int) -> None:
    """The work list against the same cut done on the host: one chunk size, a multiple of the
    tile, about total / target and doubled while there are more items than programs;
    consecutive items per sequence; the rest empty."""
    indptr = torch.tensor([0, *torch.cumsum(torch.tensor(seq_lens), 0).tolist()]).to(DEV)
    plan = decode_plan(indptr, len(seq_lens), target, block_n)
    programs = max(target, len(seq_lens))
    per_item = -(-sum(seq_lens) // programs)
    chunk = max(1, -(-per_item // block_n)) * block_n
    while sum(-(-n // chunk) for n in seq_lens) > programs:
        chunk *= 2
    counts = [-(-n // chunk) for n in seq_lens]
    firsts = [sum(counts[:i]) for i in range(len(seq_lens))]
    want_items = [i for i, c in enumerate(counts) for _ in range(c)]
    want_items += [-1] * (programs - len(want_items))
    assert plan.num_items == programs
    assert int(plan.chunk) == chunk
    assert plan.count.tolist() == counts and plan.first.tolist() == firsts
    assert plan.item_seq.tolist() == want_items


def test_decode_attention_over_very_uneven_lengths() -> None:
    """One long sequence among short ones: the long one spans many items (merged), each short
    one is a single item (written directly); a zero-length sequence reads as zeros."""
    d, heads, kv_heads, seq_lens = 16, 4, 2, [2, 900, 1, 0, 5]
    num_pages = 1 + sum(-(-n // PAGE) for n in seq_lens) + 2
    pool = _pool(num_pages, kv_heads, d, 9)
    indptr, indices = _paged_seqs(seq_lens, num_pages, 10)
    q = torch.randn(len(seq_lens), heads, d, generator=torch.Generator().manual_seed(11)).to(DEV)
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    plan = decode_plan(indptr, len(seq_lens), 8, 16)
    assert plan.count.tolist()[1] > 1 and plan.count.tolist()[0] == 1
    out = decode_attention_worklist(q, kc, vc, indptr, indices, d**-0.5, plan)
    want = decode_attention_reference(q, kc, vc, indptr, indices, d**-0.5)
    torch.testing.assert_close(out[[0, 1, 2, 4]], want[[0, 1, 2, 4]], atol=TOL, rtol=TOL)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (3, 1)])
def test_extend_attention_matches_reference(heads: int, kv_heads: int) -> None:
    d = 16
    prefix_lens, extend_lens = [0, 5, 12, 3, 9], [7, 1, 20, 35, 0]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_pages = 1 + sum(-(-n // PAGE) for n in seq_lens) + 2
    pool = _pool(num_pages, kv_heads, d, 6)
    kv_indptr, indices = _paged_seqs(seq_lens, num_pages, 7)
    qo_indptr = torch.tensor([0, *torch.cumsum(torch.tensor(extend_lens), 0).tolist()]).to(DEV)
    q = torch.randn(sum(extend_lens), heads, d,
                    generator=torch.Generator().manual_seed(8)).to(DEV)
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    out = extend_attention(q, kc, vc, qo_indptr, kv_indptr, indices, d**-0.5,
                           max_extend_len=max(extend_lens))
    want = extend_attention_reference(q, kc, vc, qo_indptr, kv_indptr, indices, d**-0.5)
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)
