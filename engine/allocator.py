"""Paged KV allocator: hands out pages of the KV pool and the token slots inside them.

A slot is a token-level KV index, `slot = page * page_size + offset`. Pages are the unit of
ownership: a page is free (held here) or owned by exactly one holder (a live request, or one node
of the radix cache). Freeing a page that is already free raises, so a double free is a loud bug,
never silent pool corruption.

Page 0 is reserved and never handed out: padded slots in CUDA graphs write there.

All index tensors are int64 CPU tensors. Not thread-safe: one scheduler thread owns the allocator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_I64 = torch.int64


def _as_index(values: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).to("cpu", _I64)
    return torch.tensor(list(values), dtype=_I64)


class PagedAllocator:
    """Free list of KV pages with page-aligned token-slot allocation for extend and decode."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages: need at least 2 (page 0 is reserved), got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size: must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.reset()

    def reset(self) -> None:
        """Return every page to the free list (only when no holder is left)."""
        # Free pages live in `_free` (sorted, handed out from the front) plus `_released` (freed
        # since the last merge). Merging sorts, so allocations favour runs of consecutive pages,
        # which become few large transfer descriptors.
        self._free = torch.arange(1, self.num_pages, dtype=_I64)
        self._released: list[torch.Tensor] = []
        self._num_released = 0
        # _is_free[p] is the single source of truth for double-free detection.
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)
        self._is_free[0] = False

    # ---- accounting -----------------------------------------------------------------------

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (all but the reserved page 0)."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return self._free.numel() + self._num_released

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def available_tokens(self) -> int:
        return self.num_free_pages * self.page_size

    def free_page_ids(self) -> torch.Tensor:
        """Sorted ids of the free pages (a copy; for metrics and tests)."""
        return torch.nonzero(self._is_free).reshape(-1)

    def is_page_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    # ---- allocation -----------------------------------------------------------------------

    def _merge_released(self) -> None:
        self._free = torch.cat([self._free, *self._released]).sort().values
        self._released = []
        self._num_released = 0

    def _take(self, n: int) -> torch.Tensor:
        # Callers checked n <= num_free_pages.
        if n > self._free.numel():
            self._merge_released()
        pages, self._free = self._free[:n], self._free[n:]
        self._is_free[pages] = False
        return pages

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """`n` fresh pages (int64 [n]), or None, allocating nothing, if fewer are free."""
        if n < 0:
            raise ValueError(f"n: must be non-negative, got {n}")
        if n > self.num_free_pages:
            return None
        return self._take(n)

    def alloc_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_locs: Sequence[int]
    ) -> torch.Tensor | None:
        """Slots for tokens [prefix_len, seq_len) of each request, concatenated in request order.

        A request first fills the rest of its partially filled last page (slots continue after
        `last_loc`, the slot of token prefix_len - 1; ignored, conventionally -1, when
        prefix_len is a multiple of page_size), then takes fresh pages, one per page boundary
        crossed. Returns None, allocating nothing, when too few pages are free.
        """
        num_reqs = len(prefix_lens)
        if len(seq_lens) != num_reqs or len(last_locs) != num_reqs:
            raise ValueError(
                f"seq_lens/last_locs: lengths {len(seq_lens)}/{len(last_locs)} "
                f"!= len(prefix_lens) {num_reqs}")
        if num_reqs == 0:
            return torch.empty(0, dtype=_I64)
        ps = self.page_size
        if num_reqs == 1 and prefix_lens[0] % ps == 0 and 0 <= prefix_lens[0] <= seq_lens[0]:
            return self._alloc_one_aligned(int(seq_lens[0]) - int(prefix_lens[0]))
        pre = torch.tensor(list(prefix_lens), dtype=_I64)
        seq = torch.tensor(list(seq_lens), dtype=_I64)
        last = torch.tensor(list(last_locs), dtype=_I64)
        if bool((pre < 0).any()):
            raise ValueError(f"prefix_lens: must be non-negative, got {list(prefix_lens)}")
        if bool((seq < pre).any()):
            raise ValueError(f"seq_lens: must be >= prefix_lens, got {list(seq_lens)}")
        held_pages = (pre + ps - 1) // ps  # pages the request already (partially) holds
        new_pages = (seq + ps - 1) // ps - held_pages
        partial = pre % ps != 0
        bad = partial & (
            (last % ps != (pre - 1) % ps) | (last < ps) | (last >= self.num_pages * ps))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"last_locs: request {i} has last_loc {int(last[i])}, which is not at offset "
                f"{(int(pre[i]) - 1) % ps} of a usable page (prefix_len {int(pre[i])})")
        num_new_pages = int(new_pages.sum())
        if num_new_pages > self.num_free_pages:
            return None
        pages = self._take(num_new_pages)

        ext = seq - pre
        total = int(ext.sum())
        if total == 0:
            return torch.empty(0, dtype=_I64)
        req = torch.repeat_interleave(torch.arange(num_reqs), ext)
        pos = torch.arange(total) - (torch.cumsum(ext, 0) - ext)[req] + pre[req]  # token index
        in_old = last[req] + (pos - pre[req] + 1)  # continuing the partial last page
        if num_new_pages == 0:
            return in_old
        k = pos // ps - held_pages[req]  # which of the request's fresh pages; < 0: partial page
        page_base = (torch.cumsum(new_pages, 0) - new_pages)[req]
        fresh = pages[(page_base + k).clamp(0, num_new_pages - 1)] * ps + pos % ps
        return torch.where(k < 0, in_old, fresh)

    def _alloc_one_aligned(self, num_tokens: int) -> torch.Tensor | None:
        """alloc_extend for one request whose prefix ends on a page boundary (a new prompt,
        the common case): fresh pages only, a few tensor ops instead of the general plan's."""
        ps = self.page_size
        need = -(-num_tokens // ps)
        if need > self.num_free_pages:
            return None
        pages = self._take(need)
        return (pages[:, None] * ps + torch.arange(ps, dtype=_I64)).reshape(-1)[:num_tokens]

    def alloc_decode(self, seq_lens: Sequence[int], last_locs: Sequence[int]
                     ) -> torch.Tensor | None:
        """One slot per request for its newest token; `seq_lens` count that token.

        A request whose new token starts a page gets a fresh page; the others continue after
        `last_loc`. Returns None, allocating nothing, when too few pages are free.
        """
        if len(last_locs) != len(seq_lens):
            raise ValueError(
                f"last_locs: length {len(last_locs)} != len(seq_lens) {len(seq_lens)}")
        ps = self.page_size
        seq = torch.tensor(list(seq_lens), dtype=_I64)
        last = torch.tensor(list(last_locs), dtype=_I64)
        if bool((seq < 1).any()):
            raise ValueError(f"seq_lens: must be >= 1, got {list(seq_lens)}")
        need = (seq - 1) % ps == 0
        bad = ~need & ((last % ps != (seq - 2) % ps) | (last < ps))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"last_locs: request {i} has last_loc {int(last[i])}, not at offset "
                f"{(int(seq[i]) - 2) % ps} of a usable page (seq_len {int(seq[i])})")
        num_new_pages = int(need.sum())
        if num_new_pages > self.num_free_pages:
            return None
        out = last + 1
        if num_new_pages:
            out[need] = self._take(num_new_pages) * ps
        return out

    # ---- release --------------------------------------------------------------------------

    def free(self, slots: torch.Tensor) -> None:
        """Free the distinct pages the given slots lie in (each must be allocated)."""
        if slots.numel() == 0:
            return
        pages = torch.unique(torch.div(_as_index(slots), self.page_size, rounding_mode="floor"))
        self._release(pages)

    def free_pages(self, pages: torch.Tensor | Sequence[int]) -> None:
        """Free the given pages; each must be allocated and listed once."""
        idx = _as_index(pages)
        if idx.numel() == 0:
            return
        uniq, counts = torch.unique(idx, return_counts=True)
        if bool((counts > 1).any()):
            raise RuntimeError(
                f"pages: double free, listed more than once: {uniq[counts > 1].tolist()[:8]}")
        self._release(uniq)

    def _release(self, pages: torch.Tensor) -> None:
        out_of_range = (pages < 1) | (pages >= self.num_pages)
        if bool(out_of_range.any()):
            raise ValueError(
                f"pages: not usable page ids (1..{self.num_pages - 1}): "
                f"{pages[out_of_range].tolist()[:8]}")
        already = self._is_free[pages]
        if bool(already.any()):
            raise RuntimeError(f"pages: double free of page(s) {pages[already].tolist()[:8]}")
        self._is_free[pages] = True
        self._released.append(pages.clone())
        self._num_released += pages.numel()
