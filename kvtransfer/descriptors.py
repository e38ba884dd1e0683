"""Page descriptors: a request's pages as runs that are consecutive on both sides.

With the page-major pool one page of all layers is one contiguous region, so a run of pages
consecutive in the source pool and in the destination pool is one contiguous byte range on each
side: one descriptor, one copy or one message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Descriptor:
    src_page: int  # first page in the sender's pool
    dst_page: int  # first page in the receiver's pool
    num_pages: int
    pos: int  # index of the first page within the request (0 = the request's first page)

    def to_list(self) -> list[int]:
        return [self.src_page, self.dst_page, self.num_pages, self.pos]

    @classmethod
    def from_list(cls, v: Sequence[int]) -> Descriptor:
        if len(v) != 4:
            raise ValueError(f"descriptor: expected 4 ints, got {list(v)!r}")
        return cls(int(v[0]), int(v[1]), int(v[2]), int(v[3]))


def merge_runs(src_pages: Sequence[int], dst_pages: Sequence[int], pos: int = 0,
               max_pages: int | None = None) -> list[Descriptor]:
    """Merge page pairs into descriptors; a run breaks where either side stops being consecutive
    (or reaches `max_pages`, to bound one message's size)."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"dst_pages: {len(dst_pages)} pages for {len(src_pages)} source pages")
    out: list[Descriptor] = []
    i, n = 0, len(src_pages)
    while i < n:
        j = i + 1
        while (j < n and src_pages[j] == src_pages[j - 1] + 1
               and dst_pages[j] == dst_pages[j - 1] + 1
               and (max_pages is None or j - i < max_pages)):
            j += 1
        out.append(Descriptor(int(src_pages[i]), int(dst_pages[i]), j - i, pos + i))
        i = j
    return out


def validate_dst(descs: Sequence[Descriptor], registered: Sequence[int], num_pool_pages: int,
                 ) -> str | None:
    """None when every descriptor writes exactly the pages registered at its positions, else why.

    The receiver's guard: a destination outside the room's registered pages (or page 0, or past
    the pool) is never written.
    """
    for d in descs:
        if d.num_pages <= 0:
            return f"descriptor at pos {d.pos}: num_pages {d.num_pages} <= 0"
        if d.pos < 0 or d.pos + d.num_pages > len(registered):
            return (f"descriptor pages [{d.pos}, {d.pos + d.num_pages}) outside the "
                    f"{len(registered)} pages registered for the room")
        if d.dst_page <= 0 or d.dst_page + d.num_pages > num_pool_pages:
            return f"destination page {d.dst_page}+{d.num_pages} outside pool [1, {num_pool_pages})"
        want = registered[d.pos:d.pos + d.num_pages]
        if any(w != d.dst_page + k for k, w in enumerate(want)):
            return f"destination pages {d.dst_page}+{d.num_pages} not registered at pos {d.pos}"
    return None
