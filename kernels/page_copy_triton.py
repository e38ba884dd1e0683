"""Page gather / scatter between a page-major pool and a contiguous staging buffer, in Triton.

Same semantics as `kernels/page_copy.py` (the torch reference): `gather_pages` does
out[i] = pool[pages[i]], `scatter_pages` does pool[pages[i]] = staging[i]. One launch copies
every page, whatever the runs, so a request of scattered pages costs one kernel instead of one
memcpy per run: both are the page-to-page copy kernel (`kernels/page_p2p_copy.py`) with the
staging side's pages 0..n-1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.kernels.page_p2p_copy import copy_pages


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


def gather_pages(pool: torch.Tensor, pages: Sequence[int] | torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """out[i] = pool[pages[i]] for each i; returns out[:len(pages)]."""
    idx = _page_tensor(pages, pool.device)
    n = idx.shape[0]
    _check(pool, out, n, "out")
    copy_pages(pool, out, idx, torch.arange(n, device=pool.device))
    return out[:n]


def scatter_pages(staging: torch.Tensor, pool: torch.Tensor,
                  pages: Sequence[int] | torch.Tensor) -> None:
    """pool[pages[i]] = staging[i] for each i."""
    idx = _page_tensor(pages, pool.device)
    n = idx.shape[0]
    _check(pool, staging, n, "staging")
    copy_pages(staging, pool, torch.arange(n, device=pool.device), idx)
