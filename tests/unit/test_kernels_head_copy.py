"""The KV-head copy between pools of different head counts (tensor-parallel workers of different
sizes): the Triton kernel against the torch reference on fresh random pools, as pool-to-pool
copies, gathers into a staging buffer of just the heads and scatters back out; under
TRITON_INTERPRET=1 on CPU, compiled on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pdserve.kernels import page_copy
from pdserve.kernels.head_copy import copy_heads

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS, PAGE, HEAD_DIM = 3, 4, 8


def _pool(pages: int, heads: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pages, LAYERS, 2, PAGE, heads, HEAD_DIM, generator=g).to(DEV, dtype)


def _pages(n: int, pool_pages: int, seed: int) -> list[int]:
    """n distinct pages, some runs consecutive, none page 0."""
    g = torch.Generator().manual_seed(seed)
    pages = (torch.randperm(pool_pages - 1, generator=g)[:n] + 1).tolist()
    return sorted(pages[: n // 2]) + pages[n // 2:]


@pytest.mark.parametrize(("src_heads", "dst_heads", "src_head", "dst_head", "num"), [
    (4, 2, 2, 0, 2),  # prefill TP 1 -> decode rank 1 of TP 2
    (2, 4, 0, 2, 2),  # prefill rank 1 of TP 2 -> decode TP 1
    (1, 3, 0, 2, 1),  # SmolLM2: prefill rank 2 of TP 3 -> decode TP 1
    (8, 8, 0, 0, 8),  # whole pages (same TP)
    (6, 4, 3, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_heads_matches_reference(src_heads: int, dst_heads: int, src_head: int,
                                      dst_head: int, num: int, dtype: torch.dtype) -> None:
    src = _pool(12, src_heads, 0, dtype)
    dst = _pool(14, dst_heads, 1, dtype)
    src_pages, dst_pages = _pages(7, 12, 2), _pages(7, 14, 3)
    want = dst.clone()
    page_copy.copy_heads(src, want, src_pages, dst_pages, src_head, dst_head, num)
    copy_heads(src, dst, src_pages, dst_pages, src_head, dst_head, num)
    assert torch.equal(dst, want)
    # The heads moved and nothing else changed (the reference is checked by hand, too).
    untouched = _pool(14, dst_heads, 1, dtype)
    for s, d in zip(src_pages, dst_pages):
        assert torch.equal(want[d, ..., dst_head:dst_head + num, :],
                           src[s, ..., src_head:src_head + num, :])
        untouched[d, ..., dst_head:dst_head + num, :] = want[d, ..., dst_head:dst_head + num, :]
    assert torch.equal(want, untouched)


def test_gather_to_staging_and_scatter_back() -> None:
    """Heads 1..2 of scattered pages into a contiguous buffer of 2-head pages (what travels
    to one decode rank), then into another pool's heads 0..1."""
    src, dst = _pool(10, 4, 4), _pool(10, 2, 5)
    pages = _pages(6, 10, 6)
    staging = torch.zeros(6, LAYERS, 2, PAGE, 2, HEAD_DIM, device=DEV)
    copy_heads(src, staging, pages, list(range(6)), 1, 0, 2)
    assert torch.equal(staging, src[pages][..., 1:3, :])
    dst_pages = _pages(6, 10, 7)
    copy_heads(staging, dst, list(range(6)), dst_pages, 0, 0, 2)
    assert torch.equal(dst[dst_pages], src[pages][..., 1:3, :])


def test_copy_heads_refuses_bad_ranges() -> None:
    src, dst = _pool(4, 2, 0), _pool(4, 4, 1)
    with pytest.raises(ValueError, match="src_head"):
        copy_heads(src, dst, [1], [1], 1, 0, 2)
    with pytest.raises(ValueError, match="dst_head"):
        page_copy.copy_heads(src, dst, [1], [1], 0, 3, 2)
    with pytest.raises(ValueError, match="more than heads"):
        copy_heads(src, _pool(4, 4, 1)[:, :2].contiguous(), [1], [1], 0, 0, 1)
