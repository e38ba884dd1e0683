"""The page-to-page copy kernel (kernels/page_p2p_copy.py) against its torch reference
(kernels/page_copy.copy_pages), under TRITON_INTERPRET=1 on CPU; compiled on a GPU machine.

The interpreter flag must be set before any `triton.jit` runs, hence before the kernel module is
imported.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pdserve.kernels import page_copy, page_p2p_copy

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(num_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype,
          seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(num_pages, *page_shape, generator=g).to(dtype)
    else:
        t = torch.randint(0, 100, (num_pages, *page_shape), generator=g).to(dtype)
    return t.to(DEV)


# Page shapes chosen so the kernel moves int64 words (several chunks per page, the last one
# partial), int32, int16 and bytes.
CASES = [
    ((2, 2, 16, 4, 33), torch.float32),  # 16896 B: 2112 int64 words, 2 chunks of 2048
    ((3, 2, 4, 2, 8), torch.bfloat16),  # the page-major KV shape of the pair tests
    ((1, 2, 1, 1, 3), torch.float16),  # 12 B: int32 words
    ((1, 2, 1, 1, 3), torch.bfloat16),  # 6 B: int16 words
    ((1, 1, 1, 1, 5), torch.uint8),  # 5 B: bytes
]


@pytest.mark.parametrize(("page_shape", "dtype"), CASES)
@pytest.mark.parametrize(("src_pages", "dst_pages"), [
    ([3, 4, 5, 9, 1], [10, 11, 12, 2, 7]),  # a run, then singles
    ([8], [1]),
    ([], []),
    ([2, 6, 1, 7], [5, 4, 3, 12]),
])
def test_copy_pages_matches_reference(page_shape: tuple[int, ...], dtype: torch.dtype,
                                      src_pages: list[int], dst_pages: list[int]) -> None:
    src = _pool(10, page_shape, dtype, 1)
    dst = _pool(13, page_shape, dtype, 2)  # the two pools need not hold as many pages
    want = dst.clone()
    page_copy.copy_pages(src, want, src_pages, dst_pages)
    page_p2p_copy.copy_pages(src, dst, torch.tensor(src_pages, dtype=torch.int64), dst_pages)
    assert torch.equal(dst, want)
    assert torch.equal(dst[dst_pages].cpu(), src[src_pages].cpu())
    untouched = [p for p in range(13) if p not in dst_pages]
    assert torch.equal(dst[untouched], _pool(13, page_shape, dtype, 2)[untouched])


def test_copy_pages_rejects_mismatch() -> None:
    src = _pool(4, (2, 2, 4, 2, 8), torch.float32, 0)
    with pytest.raises(ValueError, match="dst_pool"):
        page_p2p_copy.copy_pages(src, _pool(4, (2, 2, 4, 2, 4), torch.float32, 0), [1], [1])
    with pytest.raises(ValueError, match="dst_pool"):
        page_p2p_copy.copy_pages(src, src.to(torch.float16), [1], [1])
    with pytest.raises(ValueError, match="dst_pool"):
        page_p2p_copy.copy_pages(src, src.transpose(0, 1).contiguous().transpose(0, 1),
                                 [1], [1])
    with pytest.raises(ValueError, match="dst_pages"):
        page_p2p_copy.copy_pages(src, src.clone(), [1, 2], [1])
    with pytest.raises(ValueError, match="dst_pages"):
        page_copy.copy_pages(src, src.clone(), [1, 2], [1])


def _variants() -> int:
    """Compiled variants of the copy kernel (none under the interpreter)."""
    caches = getattr(page_p2p_copy._copy_pages_kernel, "device_caches", {})
    return sum(len(c[0]) for c in caches.values())


def test_copy_pages_index_slices_at_any_offset_share_one_kernel() -> None:
    """Index slices of one buffer at even and odd offsets (as a sender that packs a chunk's
    source and destination indices back to back passes them), on fresh random pages: equal
    to the torch reference, and on a GPU one compiled kernel for all of them, so a transfer
    never waits for another variant to be built or loaded."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    seeds = torch.randint(1 << 30, (2,), generator=g).tolist()
    src = _pool(40, (2, 2, 4, 2, 8), torch.bfloat16, seeds[0])
    dst = _pool(48, (2, 2, 4, 2, 8), torch.bfloat16, seeds[1])
    copier = page_p2p_copy.PageCopier(src, dst)
    before = None
    for n in (1, 2, 7, 16, 33):
        s = torch.randperm(40, generator=g)[:n]
        d = torch.randperm(48, generator=g)[:n]
        packed = torch.cat([s, d]).to(DEV)  # the destination slice starts at offset n
        want = dst.clone()
        page_copy.copy_pages(src, want, s.tolist(), d.tolist())
        copier(packed[:n], packed[n:])
        assert torch.equal(dst, want), n
        if before is None:
            before = _variants()
        assert _variants() == before, f"a new kernel variant for {n} pages"
