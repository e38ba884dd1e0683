"""Page-to-page copy between two page-major pools, in Triton:
`dst_pool[dst_pages[i]] = src_pool[src_pages[i]]` for every i, in one launch.

The torch reference is `kernels.page_copy.copy_pages`. The pools may live on different GPUs:
the cuda_ipc transfer backend passes the peer's pool mapped through CUDA IPC as `dst_pool` and
runs the kernel on that pool's GPU (peer access enabled), which reads the source pages over
NVLink and stores them locally, so a chunk of scattered pages needs neither a staging buffer
nor one copy call per run. Gather and scatter against a staging buffer (page_copy_triton) are
the special cases where one side's pages are 0..n-1.

Each page of a pool (`pool[p]`) must be contiguous, which the page-major layout
`[pages, layers, 2, page_size, kv_heads, head_dim]` guarantees. Grid: (chunks of a page, pages);
a program moves BLOCK words of the widest integer type that divides the page and both base
addresses (int64 for every real KV page), so its loads and stores are wide vectors.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Protocol

import torch
import triton
import triton.language as tl

from pdserve.kernels.page_copy import check_pools

BLOCK = 2048  # words per program: 16 KiB of int64; a 2 MiB page is 128 programs
NUM_WARPS = 8
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension


# Not specialised on the index pointers' alignment (the indices are loaded one at a time):
# otherwise a slice of an index buffer at an odd offset is another kernel to build, which a
# first transfer of the other parity than the warm-up's paid for (about 3 ms on an H100).
@triton.jit(do_not_specialize_on_alignment=["src_pages_ptr", "dst_pages_ptr"])
def _copy_pages_kernel(src_ptr, dst_ptr, src_pages_ptr, dst_pages_ptr, page_words,
                       BLOCK: tl.constexpr):
    # Grid (chunks of a page, pages): neighbouring programs stream through one page, so the
    # programs in flight touch a few pages at a time. Page-major order (every page's first
    # chunk, then every page's second...) ran 4% slower between two H200s.
    chunk = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    src_page = tl.load(src_pages_ptr + i).to(tl.int64)
    dst_page = tl.load(dst_pages_ptr + i).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_words
    words = tl.load(src_ptr + src_page * page_words + offs, mask=mask,
                    eviction_policy="evict_first")  # read once: keep it out of L2
    tl.store(dst_ptr + dst_page * page_words + offs, words, mask=mask)


def _words(pool: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pool as `[num_pages, page_words]` of an integer dtype (a view, no copy)."""
    return pool.view(pool.shape[0], math.prod(pool.shape[1:])).view(torch.uint8).view(dtype)


def _word_dtype(page_bytes: int, *ptrs: int) -> torch.dtype:
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if page_bytes % size == 0 and all(p % size == 0 for p in ptrs):
            return dtype
    return torch.uint8


def _index(pages: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(pages, torch.Tensor):
        return pages.to(device=device, dtype=torch.int64, non_blocking=True).reshape(-1)
    return torch.tensor([int(p) for p in pages], dtype=torch.int64, device=device)


class PageCopier:
    """`dst_pool[dst_pages[i]] = src_pool[src_pages[i]]` between two fixed pools, checked and
    viewed once, so a transfer's launch costs only the kernel launch (the cuda_ipc backend
    keeps one per peer). `device`: the GPU that runs the kernel, the source's by default; the
    cuda_ipc backend runs it on the destination's (a pool mapped from another process's IPC
    handle is reachable only from the GPU it lives on)."""

    def __init__(self, src_pool: torch.Tensor, dst_pool: torch.Tensor,
                 device: torch.device | None = None) -> None:
        check_pools(src_pool, dst_pool)
        if not src_pool.is_contiguous() or not dst_pool.is_contiguous():
            raise ValueError("dst_pool: both pools must be contiguous page-major tensors")
        page_bytes = math.prod(src_pool.shape[1:]) * src_pool.element_size()
        word = _word_dtype(page_bytes, src_pool.data_ptr(), dst_pool.data_ptr())
        self.device = device or src_pool.device
        self._src_w, self._dst_w = _words(src_pool, word), _words(dst_pool, word)
        self._page_words = self._src_w.shape[1]
        self._chunks = triton.cdiv(self._page_words, BLOCK) if page_bytes else 0

    def __call__(self, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        """int64 page indices on `self.device`, launched on its current stream (the caller
        makes that device current). Not bounds-checked: callers pass validated pages."""
        n = src_idx.numel()
        if n == 0 or self._chunks == 0:
            return
        for lo in range(0, n, _MAX_GRID_Y):  # one launch below 65,535 pages, as a rule
            hi = min(n, lo + _MAX_GRID_Y)
            _copy_pages_kernel[(self._chunks, hi - lo)](
                self._src_w, self._dst_w, src_idx[lo:hi], dst_idx[lo:hi], self._page_words,
                BLOCK=BLOCK, num_warps=NUM_WARPS)


def copy_pages(src_pool: torch.Tensor, dst_pool: torch.Tensor,
               src_pages: Sequence[int] | torch.Tensor,
               dst_pages: Sequence[int] | torch.Tensor) -> None:
    """dst_pool[dst_pages[i]] = src_pool[src_pages[i]] for each i, launched on src_pool's
    device (on its current stream). Page indices are not bounds-checked here: callers pass
    validated pages (out-of-range indices would read or write outside the pools)."""
    launch(PageCopier(src_pool, dst_pool), src_pages, dst_pages)


class Copier(Protocol):
    """Copies pages given as int64 index tensors on `device` (PageCopier, HeadCopier)."""

    device: torch.device

    def __call__(self, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None: ...


def launch(copier: Copier, src_pages: Sequence[int] | torch.Tensor,
           dst_pages: Sequence[int] | torch.Tensor) -> None:
    """Runs `copier` on its device (current stream), the page lists moved there first."""
    device = copier.device
    src_idx, dst_idx = _index(src_pages, device), _index(dst_pages, device)
    if src_idx.shape != dst_idx.shape:
        raise ValueError(f"dst_pages: {dst_idx.numel()} pages for {src_idx.numel()} source pages")
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        copier(src_idx, dst_idx)
