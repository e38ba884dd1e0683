"""Page gather / scatter between a page-major KV pool and a contiguous staging buffer, page to
page copy between two pools, and the copy of a range of KV heads of pages between two pools of
different head counts (tensor-parallel workers of different sizes).

Plain torch reference; this is the API faster kernels must match. A pool is any tensor whose
first dimension is the page (`[num_pages, ...]`); `pages` are page indices. Runs of consecutive
pages are copied as one slice so a contiguous request costs one memcpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(offset in the request, first page, length) for each run of consecutive pages."""
    out: list[tuple[int, int, int]] = []
    i, n = 0, len(pages)
    while i < n:
        j = i + 1
        while j < n and pages[j] == pages[j - 1] + 1:
            j += 1
        out.append((i, int(pages[i]), j - i))
        i = j
    return out


def _as_list(pages: Sequence[int] | torch.Tensor) -> list[int]:
    return pages.tolist() if isinstance(pages, torch.Tensor) else [int(p) for p in pages]


def _check(pool: torch.Tensor, staging: torch.Tensor, n: int, name: str) -> None:
    if staging.shape[0] < n or tuple(staging.shape[1:]) != tuple(pool.shape[1:]):
        raise ValueError(f"{name}: shape {tuple(staging.shape)} cannot hold {n} pages of "
                         f"{tuple(pool.shape[1:])}")
    if staging.dtype != pool.dtype:
        raise ValueError(f"{name}: dtype {staging.dtype} != pool dtype {pool.dtype}")


def gather_pages(pool: torch.Tensor, pages: Sequence[int] | torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """out[i] = pool[pages[i]] for each i; returns out[:len(pages)]."""
    idx = _as_list(pages)
    _check(pool, out, len(idx), "out")
    for off, first, length in _runs(idx):
        out[off:off + length].copy_(pool[first:first + length])
    return out[:len(idx)]


def scatter_pages(staging: torch.Tensor, pool: torch.Tensor,
                  pages: Sequence[int] | torch.Tensor) -> None:
    """pool[pages[i]] = staging[i] for each i."""
    idx = _as_list(pages)
    _check(pool, staging, len(idx), "staging")
    for off, first, length in _runs(idx):
        pool[first:first + length].copy_(staging[off:off + length])


def check_pools(src_pool: torch.Tensor, dst_pool: torch.Tensor) -> None:
    """ValueError unless the two pools hold pages of the same shape and dtype."""
    if tuple(src_pool.shape[1:]) != tuple(dst_pool.shape[1:]) or src_pool.dtype != dst_pool.dtype:
        raise ValueError(f"dst_pool: pages {tuple(dst_pool.shape[1:])} {dst_pool.dtype} != "
                         f"source pages {tuple(src_pool.shape[1:])} {src_pool.dtype}")


def copy_pages(src_pool: torch.Tensor, dst_pool: torch.Tensor,
               src_pages: Sequence[int] | torch.Tensor,
               dst_pages: Sequence[int] | torch.Tensor) -> None:
    """dst_pool[dst_pages[i]] = src_pool[src_pages[i]] for each i (the pools may sit on two
    devices); pages consecutive on both sides are copied as one slice."""
    src, dst = _as_list(src_pages), _as_list(dst_pages)
    if len(src) != len(dst):
        raise ValueError(f"dst_pages: {len(dst)} pages for {len(src)} source pages")
    check_pools(src_pool, dst_pool)
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        dst_pool[dst[i]:dst[i] + j - i].copy_(src_pool[src[i]:src[i] + j - i])
        i = j


def check_head_pools(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_head: int,
                     dst_head: int, num_heads: int) -> None:
    """ValueError unless both are page-major pools `[pages, layers, 2, page_size, heads,
    head_dim]` alike but for their head counts, and the head ranges lie inside them."""
    if src_pool.dim() != 6 or dst_pool.dim() != 6:
        raise ValueError(f"dst_pool: expected page-major pools, got {tuple(src_pool.shape)} and "
                         f"{tuple(dst_pool.shape)}")
    same = (src_pool.shape[1:4] == dst_pool.shape[1:4] and src_pool.shape[5] == dst_pool.shape[5]
            and src_pool.dtype == dst_pool.dtype)
    if not same:
        raise ValueError(f"dst_pool: pages {tuple(dst_pool.shape[1:])} {dst_pool.dtype} differ "
                         f"from {tuple(src_pool.shape[1:])} {src_pool.dtype} in more than heads")
    for name, head, pool in (("src_head", src_head, src_pool), ("dst_head", dst_head, dst_pool)):
        if num_heads <= 0 or head < 0 or head + num_heads > pool.shape[4]:
            raise ValueError(f"{name}: heads [{head}, {head + num_heads}) outside the pool's "
                             f"{pool.shape[4]}")


def copy_heads(src_pool: torch.Tensor, dst_pool: torch.Tensor,
               src_pages: Sequence[int] | torch.Tensor, dst_pages: Sequence[int] | torch.Tensor,
               src_head: int, dst_head: int, num_heads: int) -> None:
    """dst_pool[dst_pages[i], ..., dst_head + h, :] = src_pool[src_pages[i], ..., src_head + h, :]
    for every i and h < num_heads: KV heads [src_head, src_head + num_heads) of each source page
    into heads [dst_head, ...) of its destination page, every layer, K and V, every token. A
    staging buffer holding just those heads is a pool of num_heads heads (pages 0..n-1)."""
    src, dst = _as_list(src_pages), _as_list(dst_pages)
    if len(src) != len(dst):
        raise ValueError(f"dst_pages: {len(dst)} pages for {len(src)} source pages")
    check_head_pools(src_pool, dst_pool, src_head, dst_head, num_heads)
    s_heads, d_heads = slice(src_head, src_head + num_heads), slice(dst_head, dst_head + num_heads)
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        dst_pool[dst[i]:dst[i] + j - i, :, :, :, d_heads].copy_(
            src_pool[src[i]:src[i] + j - i, :, :, :, s_heads])
        i = j
