"""Page descriptors: a request's pages as runs that are consecutive on both sides.

With the page-major pool one page of all layers is one contiguous region, so a run of pages
consecutive in the source pool and in the destination pool is one contiguous byte range on each
side: one descriptor, one copy or one message.

A chunk's descriptors are one int64 array of shape `[n, 4]`, a row per run:
`(src_page, dst_page, num_pages, pos)`, where `pos` is the index of the run's first page within
the request. Arrays, not objects: a scattered 4096-token request has hundreds of runs, and the
control path builds, encodes, validates and counts them once per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

SRC, DST, NUM, POS = range(4)  # columns


def as_pages(pages: Sequence[int] | np.ndarray | Any) -> np.ndarray:
    """A page list (list, numpy array or torch tensor) as a 1-D int64 array."""
    if hasattr(pages, "cpu"):  # a torch tensor, maybe on a GPU
        pages = pages.cpu().numpy()
    return np.asarray(pages, dtype=np.int64).reshape(-1)


def descs(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """A descriptor array from rows of (src_page, dst_page, num_pages, pos)."""
    out = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    return np.ascontiguousarray(out)


def merge_runs(src_pages: Sequence[int] | np.ndarray, dst_pages: Sequence[int] | np.ndarray,
               pos: int = 0, max_pages: int | None = None) -> np.ndarray:
    """Merge page pairs into descriptors; a run breaks where either side stops being consecutive
    (or reaches `max_pages`, to bound one message's size)."""
    src, dst = as_pages(src_pages), as_pages(dst_pages)
    if len(src) != len(dst):
        raise ValueError(f"dst_pages: {len(dst)} pages for {len(src)} source pages")
    n = len(src)
    if n == 0:
        return np.empty((0, 4), dtype=np.int64)
    brk = np.ones(n, dtype=bool)
    brk[1:] = (src[1:] != src[:-1] + 1) | (dst[1:] != dst[:-1] + 1)
    starts = np.flatnonzero(brk)
    lens = np.diff(np.append(starts, n))
    if max_pages is not None and int(lens.max()) > max_pages:
        # Split long runs into pieces of max_pages (the last one shorter).
        pieces = -(-lens // max_pages)
        run = np.repeat(np.arange(len(starts)), pieces)
        k = np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        starts, lens = starts[run] + k * max_pages, np.minimum(max_pages, lens[run] - k * max_pages)
    return np.stack([src[starts], dst[starts], lens, starts + pos], axis=1)


def run_pages(d: np.ndarray, col: int) -> np.ndarray:
    """Every page the descriptors cover, row by row, as numbered by column `col`: SRC (pages of
    the sender's pool), DST (the receiver's) or POS (positions within the request)."""
    num = d[:, NUM]
    offs = np.arange(int(num.sum())) - np.repeat(np.cumsum(num) - num, num)
    return np.repeat(d[:, col], num) + offs


def validate_dst(d: np.ndarray, registered: np.ndarray, num_pool_pages: int) -> str | None:
    """None when every descriptor writes exactly the pages registered at its positions, else why.

    The receiver's guard: a destination outside the room's registered pages (or page 0, or past
    the pool) is never written. `registered` is the room's destination pages (int64 array).
    """
    if d.ndim != 2 or d.shape[1] != 4:
        return f"descriptors: shape {tuple(d.shape)}, expected [n, 4]"
    dst, num, pos = d[:, DST], d[:, NUM], d[:, POS]
    n_reg = len(registered)
    for bad, why in (
            (num <= 0, "num_pages <= 0"),
            ((pos < 0) | (pos + num > n_reg), f"outside the {n_reg} pages registered for the room"),
            ((dst <= 0) | (dst + num > num_pool_pages), f"outside pool [1, {num_pool_pages})")):
        if bad.any():
            i = int(np.argmax(bad))
            return (f"descriptor {i} (destination page {dst[i]}+{num[i]} at pos {pos[i]}): "
                    f"{why}")
    total = int(num.sum())
    if total > n_reg:
        return f"descriptors cover {total} pages, the room registered {n_reg}"
    wrong = registered[run_pages(d, POS)] != run_pages(d, DST)
    if wrong.any():
        i = int(np.repeat(np.arange(len(d)), num)[int(np.argmax(wrong))])
        return (f"descriptor {i}: destination pages {dst[i]}+{num[i]} not registered at pos "
                f"{pos[i]}")
    return None


def coalesce(d: np.ndarray) -> np.ndarray:
    """`[k, 3]` rows of (src_page, dst_page, num_pages): the descriptors with neighbours that
    continue on both sides merged again (merge_runs caps runs for messages; a copy needs no cap).
    """
    if len(d) == 0:
        return np.empty((0, 3), dtype=np.int64)
    src, dst, num = d[:, SRC], d[:, DST], d[:, NUM]
    brk = np.ones(len(d), dtype=bool)
    brk[1:] = (src[1:] != src[:-1] + num[:-1]) | (dst[1:] != dst[:-1] + num[:-1])
    starts = np.flatnonzero(brk)
    return np.stack([src[starts], dst[starts], np.add.reduceat(num, starts)], axis=1)


def check_runs(runs: np.ndarray, n_peer: int, n_local: int, peer: str) -> None:
    """A one-sided sender's guard on `coalesce` rows: every destination inside the peer's pool
    and every source inside ours (page 0 excluded on both); raises ValueError."""
    src, dst, num = runs[:, 0], runs[:, 1], runs[:, 2]
    if dst.min() <= 0 or int((dst + num).max()) > n_peer:
        raise ValueError(f"destination pages outside the pool of peer {peer} [1, {n_peer})")
    if src.min() <= 0 or int((src + num).max()) > n_local:
        raise ValueError(f"source pages outside the local pool [1, {n_local})")
