"""Page gather / scatter between a page-major pool and a contiguous staging buffer, in Triton.

Same semantics as `kernels/page_copy.py` (the torch reference): `gather_pages` does
out[i] = pool[pages[i]], `scatter_pages` does pool[pages[i]] = staging[i]. One launch copies
every page, whatever the runs, so a request of scattered pages costs one kernel instead of one
memcpy per run. Each page of the pool (`pool[p]`) must be contiguous, which the page-major
layout guarantees; the grid is (pages, chunks of one page).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program; a 2 MiB bf16 page is 256 programs


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, page_ptr, page_numel,
                       GATHER: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    page = tl.load(page_ptr + i).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_numel
    if GATHER:
        src = page * page_numel + offs
        dst = i * page_numel + offs
    else:
        src = i * page_numel + offs
        dst = page * page_numel + offs
    tl.store(dst_ptr + dst, tl.load(src_ptr + src, mask=mask), mask=mask)


def _page_tensor(pages: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(pages, torch.Tensor):
        return pages.to(device=device, dtype=torch.int64)
    return torch.tensor([int(p) for p in pages], dtype=torch.int64, device=device)


def _check(pool: torch.Tensor, staging: torch.Tensor, n: int, name: str) -> None:
    if staging.shape[0] < n or tuple(staging.shape[1:]) != tuple(pool.shape[1:]):
        raise ValueError(f"{name}: shape {tuple(staging.shape)} cannot hold {n} pages of "
                         f"{tuple(pool.shape[1:])}")
    if staging.dtype != pool.dtype:
        raise ValueError(f"{name}: dtype {staging.dtype} != pool dtype {pool.dtype}")
    if not pool.is_contiguous() or not staging.is_contiguous():
        raise ValueError(f"{name}: pool and staging must be contiguous page-major tensors")
    if staging.device != pool.device:
        raise ValueError(f"{name}: device {staging.device} != pool device {pool.device}")


def _launch(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor, gather: bool,
            page_numel: int) -> None:
    n = pages.shape[0]
    if n == 0 or page_numel == 0:
        return
    grid = (n, triton.cdiv(page_numel, BLOCK))
    _copy_pages_kernel[grid](src, dst, pages, page_numel, GATHER=gather, BLOCK=BLOCK,
                             num_warps=8)


def gather_pages(pool: torch.Tensor, pages: Sequence[int] | torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """out[i] = pool[pages[i]] for each i; returns out[:len(pages)]."""
    idx = _page_tensor(pages, pool.device)
    _check(pool, out, idx.shape[0], "out")
    _launch(pool, out, idx, True, pool[0].numel())
    return out[:idx.shape[0]]


def scatter_pages(staging: torch.Tensor, pool: torch.Tensor,
                  pages: Sequence[int] | torch.Tensor) -> None:
    """pool[pages[i]] = staging[i] for each i."""
    idx = _page_tensor(pages, pool.device)
    _check(pool, staging, idx.shape[0], "staging")
    _launch(staging, pool, idx, False, pool[0].numel())
