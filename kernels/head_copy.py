"""Copy a range of KV heads of pages between two page-major pools of different head counts, in
Triton: `dst_pool[dst_pages[i], ..., dst_head + h, :] = src_pool[src_pages[i], ..., src_head + h,
:]` for every i and h < num_heads, in one launch.

Why: tensor-parallel workers of different sizes hold different KV heads per rank. A prefill
rank's page interleaves its heads within every (layer, K/V, token) row, so the heads one decode
rank owns are strided in it (or land strided in the decode rank's page). This kernel gathers them
into a staging buffer of just those heads (a pool of `num_heads` heads, pages 0..n-1), scatters
them back out, or copies pool to pool directly, whatever the runs of pages. The torch reference
is `kernels.page_copy.copy_heads`.

Layout: a page is `rows = layers * 2 * page_size` rows of `heads * head_dim` elements; the copy
moves `num_heads * head_dim` consecutive elements of each row. Grid: (blocks of ROWS rows,
pages); a program moves a [ROWS, COLS] tile of the widest integer words that divide a head's
bytes and both base addresses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pdserve.kernels.page_copy import check_head_pools
from pdserve.kernels.page_p2p_copy import _MAX_GRID_Y, launch

TILE = 4096  # words per program
NUM_WARPS = 4


@triton.jit
def _copy_heads_kernel(src_ptr, dst_ptr, src_pages_ptr, dst_pages_ptr, rows, src_row, dst_row,
                       src_off, dst_off, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    src_page = tl.load(src_pages_ptr + i).to(tl.int64)
    dst_page = tl.load(dst_pages_ptr + i).to(tl.int64)
    r = block * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, COLS)[None, :]
    mask = (r < rows) & (c < width)
    src = src_ptr + (src_page * rows + r) * src_row + src_off + c
    dst = dst_ptr + (dst_page * rows + r) * dst_row + dst_off + c
    tl.store(dst, tl.load(src, mask=mask, eviction_policy="evict_first"), mask=mask)


def _word_dtype(head_bytes: int, *ptrs: int) -> tuple[torch.dtype, int]:
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if head_bytes % size == 0 and all(p % size == 0 for p in ptrs):
            return dtype, size
    return torch.uint8, 1


class HeadCopier:
    """Heads [src_head, src_head + num_heads) of `src_pool`'s pages into heads [dst_head, ...)
    of `dst_pool`'s, checked and laid out once (a transfer keeps one per rank pair). `device`:
    the GPU that runs the kernel, the source's by default."""

    def __init__(self, src_pool: torch.Tensor, dst_pool: torch.Tensor, src_head: int,
                 dst_head: int, num_heads: int, device: torch.device | None = None) -> None:
        check_head_pools(src_pool, dst_pool, src_head, dst_head, num_heads)
        if not src_pool.is_contiguous() or not dst_pool.is_contiguous():
            raise ValueError("dst_pool: both pools must be contiguous page-major tensors")
        head_dim, es = src_pool.shape[5], src_pool.element_size()
        word, size = _word_dtype(head_dim * es, src_pool.data_ptr(), dst_pool.data_ptr())
        per_head = head_dim * es // size  # words of one head in one row
        self.device = device or src_pool.device
        self._src = src_pool.view(-1).view(torch.uint8).view(word)
        self._dst = dst_pool.view(-1).view(torch.uint8).view(word)
        self._rows = math.prod(src_pool.shape[1:4])
        self._src_row, self._dst_row = src_pool.shape[4] * per_head, dst_pool.shape[4] * per_head
        self._src_off, self._dst_off = src_head * per_head, dst_head * per_head
        self._width = num_heads * per_head
        self._cols = triton.next_power_of_2(self._width)
        self._block_rows = max(1, min(triton.next_power_of_2(self._rows), TILE // self._cols))

    def __call__(self, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        """int64 page indices on `self.device`, launched on its current stream. Not
        bounds-checked: callers pass validated pages."""
        n = src_idx.numel()
        if n == 0 or self._rows == 0:
            return
        blocks = triton.cdiv(self._rows, self._block_rows)
        for lo in range(0, n, _MAX_GRID_Y):
            hi = min(n, lo + _MAX_GRID_Y)
            _copy_heads_kernel[(blocks, hi - lo)](
                self._src, self._dst, src_idx[lo:hi], dst_idx[lo:hi], self._rows,
                self._src_row, self._dst_row, self._src_off, self._dst_off, self._width,
                ROWS=self._block_rows, COLS=self._cols, num_warps=NUM_WARPS)


def copy_heads(src_pool: torch.Tensor, dst_pool: torch.Tensor,
               src_pages: Sequence[int] | torch.Tensor, dst_pages: Sequence[int] | torch.Tensor,
               src_head: int, dst_head: int, num_heads: int) -> None:
    """As `kernels.page_copy.copy_heads`, in one launch on src_pool's device (current stream).
    Page indices are not bounds-checked here: callers pass validated pages."""
    launch(HeadCopier(src_pool, dst_pool, src_head, dst_head, num_heads), src_pages, dst_pages)
