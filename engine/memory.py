"""KVMemory: the KV pool with its allocator, request slots and radix cache, as one owner.

Every path that takes or returns KV pages for a request goes through here, so the ownership
rules live in one place (see engine/req.py for a request's share):
- `admit` gives a request a ReqToTokenPool row and locks its cached prefix;
- `alloc_extend` / `alloc_decode` add slots at the end of its row;
- `release` hands its KV to the radix cache (deduplicated, unaligned tail freed), unlocks the
  prefix and frees the row. After release the request owns nothing.
When the allocator runs short, unlocked radix leaves are evicted (LRU) before giving up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.allocator import PagedAllocator
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.radix_cache import RadixCache
from pdserve.engine.req import Req
from pdserve.engine.req_to_token import ReqToTokenPool


@dataclass(frozen=True)
class MemoryStats:
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_cached: int  # held only by the radix cache, evictable
    kv_pages_in_use: int  # held by live requests (or locked for them)


class KVMemory:
    def __init__(self, pool: KVPool, max_reqs: int, max_context_len: int,
                 disable_radix_cache: bool = False) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.allocator = PagedAllocator(pool.num_pages, pool.page_size)
        self.req_to_token = ReqToTokenPool(max_reqs, max_context_len, "cpu")
        self.tree = RadixCache(self.allocator, pool.page_size, disable=disable_radix_cache)
        self.max_context_len = max_context_len

    # ---- admission and growth ---------------------------------------------------------------

    def admit(self, req: Req, use_cache: bool = True) -> bool:
        """Give `req` a row and its longest cached prefix (at least one token left to compute)."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        req.kv_len = req.prefix_len = 0
        req.last_node = None
        if use_cache:
            match = self.tree.match_prefix(req.fill_ids[:-1], req.namespace)
            n = int(match.slots.numel())
            self.tree.inc_lock_ref(match.last_node)
            req.last_node = match.last_node
            if n:
                self.req_to_token.write(row, 0, match.slots)
            req.kv_len = req.prefix_len = n
        if not req.admitted:
            req.cached_tokens = req.prefix_len
            req.admitted = True
        return True

    def ensure_free_tokens(self, num_tokens: int) -> bool:
        short = num_tokens - self.allocator.available_tokens
        if short > 0:
            self.tree.evict(short)
        return self.allocator.available_tokens >= num_tokens

    def _last_loc(self, req: Req) -> int:
        if req.kv_len == 0:
            return -1
        return int(self.req_to_token.read(req.req_pool_idx, req.kv_len - 1, req.kv_len)[0])

    def alloc_extend(self, req: Req, num_tokens: int) -> bool:
        """Slots for fill_ids[kv_len : kv_len + num_tokens], written to the row (kv_len is
        unchanged)."""
        if req.kv_len + num_tokens > self.max_context_len:
            raise ValueError(
                f"prompt: {req.kv_len + num_tokens} tokens exceed the context of "
                f"{self.max_context_len}")
        if not self.ensure_free_tokens(num_tokens + self.page_size):
            return False
        slots = self.allocator.alloc_extend(
            [req.kv_len], [req.kv_len + num_tokens], [self._last_loc(req)])
        if slots is None:
            return False
        self.req_to_token.write(req.req_pool_idx, req.kv_len, slots)
        return True

    def alloc_decode(self, reqs: list[Req]) -> bool:
        """One slot per request for its token at position seq_len - 1 (== kv_len)."""
        if not reqs:
            return True
        if not self.ensure_free_tokens(len(reqs) * self.page_size):
            # Decode needs a page only at page boundaries; try the exact need first.
            need = sum(1 for r in reqs if r.kv_len % self.page_size == 0) * self.page_size
            if not self.ensure_free_tokens(need):
                return False
        rows = [r.req_pool_idx for r in reqs]
        kv_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        # Each request's last slot (-1 for one with no KV yet), gathered in one indexing op.
        last = self.req_to_token.read_tokens(rows, (kv_lens - 1).clamp_min(0))
        last = torch.where(kv_lens > 0, last, -1)
        slots = self.allocator.alloc_decode((kv_lens + 1).tolist(), last.tolist())
        if slots is None:
            return False
        self.req_to_token.write_tokens(rows, kv_lens, slots)
        return True

    # ---- release ------------------------------------------------------------------------------

    def slots_of(self, req: Req, end: int | None = None) -> torch.Tensor:
        return self.req_to_token.read(req.req_pool_idx, 0, req.kv_len if end is None else end)

    def release(self, req: Req, extra_slots: int = 0) -> None:
        """Hand the request's KV [0, kv_len) to the radix cache and free its row.

        `extra_slots`: slots allocated past kv_len (an aborted in-flight forward) to free too.
        """
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        # Pages that start at or after kv_len hold only the extra slots; a partial page at
        # kv_len is still the request's and goes through cache_finished_req below.
        start = -(-req.kv_len // self.page_size) * self.page_size
        if req.kv_len + extra_slots > start:
            self.allocator.free(self.req_to_token.read(row, start, req.kv_len + extra_slots))
        tokens = req.fill_ids[:req.kv_len]
        self.tree.cache_finished_req(
            tokens, self.slots_of(req), req.prefix_len, req.last_node, req.namespace)
        self.req_to_token.free(row)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_len = req.prefix_len = 0

    # ---- accounting ---------------------------------------------------------------------------

    def stats(self) -> MemoryStats:
        total = self.allocator.num_usable_pages
        free = self.allocator.num_free_pages
        cached = self.tree.evictable_tokens // self.page_size
        return MemoryStats(total, free, cached, total - free - cached)
