"""Page-aligned radix cache: shares KV pages between requests with a common token prefix.

Ownership invariant: every allocated page is owned by exactly one of
  - the tree: exactly one node, whose `value` holds all of the page's slots, or
  - one live request: the part of its slots it did not get from the tree, i.e. its slots
    [prefix_len, seq_len), including its partially filled tail page.
So `allocator.num_free_pages + tree pages + pages of live requests == allocator.num_usable_pages`.
A request borrows its matched prefix [0, prefix_len) from the tree and keeps it alive by
holding a lock on `last_node` (inc_lock_ref after match, dec_lock_ref through cache_*_req).

Keys are compared page by page: only whole pages are cached, a node's key length is always a
multiple of page_size, and nodes are split only at page boundaries. A namespace (any hashable:
a LoRA id, a model id) selects a separate root, so different namespaces never share pages.

Callers must always leave at least one token to compute: match on `token_ids[:-1]` (the match
is page-aligned and may cover every token it is given).

With `disable=True` match finds nothing and insert frees what it is given, so callers follow
the same protocol either way. Not thread-safe: one scheduler thread owns the cache.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator, Sequence

import torch

from pdserve.engine.allocator import PagedAllocator
from pdserve.engine.radix_node import (
    MatchResult,
    TreeNode,
    check_whole_pages,
    format_tree,
    match_len,
    split_node,
    token_list,
)


class RadixCache:
    """Radix tree over token ids whose values are KV slot tensors (int64, CPU)."""

    def __init__(self, allocator: PagedAllocator, page_size: int, disable: bool = False) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size: {page_size} != allocator.page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self._init_tree()

    def _init_tree(self) -> None:
        self._roots: dict[Hashable, TreeNode] = {}
        self._clock = 0  # logical time for LRU; bumped once per match / insert
        self._next_id = 0
        self._evictable_tokens = 0  # tokens in nodes with lock_ref == 0
        self._protected_tokens = 0  # tokens in nodes with lock_ref > 0

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def root(self, namespace: Hashable | None = None) -> TreeNode:
        """The root of a namespace (created on first use; roots hold no pages)."""
        node = self._roots.get(namespace)
        if node is None:
            node = TreeNode([], torch.empty(0, dtype=torch.int64), None, self._take_id(), namespace)
            self._roots[namespace] = node
        return node

    def reset(self) -> None:
        """Free every cached page and empty the tree; no request may hold a lock."""
        if self._protected_tokens:
            raise RuntimeError(f"reset: {self._protected_tokens} tokens are locked by requests")
        self._free_nodes(list(self.nodes()))
        self._init_tree()

    # ---- accounting -----------------------------------------------------------------------

    @property
    def evictable_tokens(self) -> int:
        return self._evictable_tokens

    @property
    def protected_tokens(self) -> int:
        return self._protected_tokens

    @property
    def evictable_pages(self) -> int:
        """Pages held only by the tree (no live request uses them)."""
        return self._evictable_tokens // self.page_size

    @property
    def total_cached_pages(self) -> int:
        return (self._evictable_tokens + self._protected_tokens) // self.page_size

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, depth first."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.is_root:
                yield node

    # ---- matching and insertion -------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor,
                     namespace: Hashable | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `token_ids`; marks its path recently used.

        The returned slots are owned by the tree: lock `last_node` before anything can evict.
        """
        root = self.root(namespace)
        ids = token_list(token_ids)
        if self.disable:
            return MatchResult(torch.empty(0, dtype=torch.int64), root)
        ps = self.page_size
        aligned = len(ids) // ps * ps
        self._clock += 1
        node, pos, values = root, 0, []
        while pos < aligned:
            child = node.children.get(tuple(ids[pos:pos + ps]))
            if child is None:
                break
            child.last_access = self._clock
            m = match_len(child.key, ids, pos, aligned, ps)
            if m < len(child.key):
                child = split_node(child, m, ps, self._take_id())
            values.append(child.value)
            pos += m
            node = child
        slots = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return MatchResult(slots, node)

    def insert(self, token_ids: Sequence[int] | torch.Tensor, slots: torch.Tensor,
               namespace: Hashable | None = None) -> int:
        """Insert the page-aligned prefix of (token_ids, slots).

        Returns the length already in the tree. The tree takes ownership of the caller's
        slots [returned_len, aligned_len); the caller still owns [own_prefix_len, returned_len)
        (duplicates of what the tree holds: free them) and its unaligned tail.
        """
        ids = token_list(token_ids)
        if len(ids) != slots.numel():
            raise ValueError(f"slots: {slots.numel()} slots for {len(ids)} token ids")
        ps = self.page_size
        aligned = len(ids) // ps * ps
        value = slots.reshape(-1)[:aligned].to("cpu", torch.int64)
        if self.disable:
            self.allocator.free(value)
            return 0
        check_whole_pages(value, self.page_size)
        self._clock += 1
        node, pos = self.root(namespace), 0
        while pos < aligned:
            first = tuple(ids[pos:pos + ps])
            child = node.children.get(first)
            if child is None:
                leaf = TreeNode(ids[pos:aligned], value[pos:aligned].clone(), node,
                                self._take_id(), namespace, self._clock)
                node.children[first] = leaf
                self._evictable_tokens += aligned - pos
                return pos
            child.last_access = self._clock
            m = match_len(child.key, ids, pos, aligned, ps)
            if m < len(child.key):
                child = split_node(child, m, ps, self._take_id())
            pos += m
            node = child
        return aligned

    # ---- locks ------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Lock the path root..node against eviction (a no-op on a root or None)."""
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self._evictable_tokens -= len(node.key)
                self._protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """Release one lock taken by inc_lock_ref on the same node (a no-op on a root or None)."""
        if node is not None and not node.is_root and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref: node {node.node_id} is not locked")
        while node is not None and not node.is_root:
            if node.lock_ref == 1:
                self._evictable_tokens += len(node.key)
                self._protected_tokens -= len(node.key)
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    # ---- request protocol -------------------------------------------------------------------

    def _check_req(self, ids: list[int], slots: torch.Tensor, prefix_len: int) -> torch.Tensor:
        if len(ids) != slots.numel():
            raise ValueError(f"slots: {slots.numel()} slots for {len(ids)} token ids")
        if not 0 <= prefix_len <= len(ids) or prefix_len % self.page_size:
            raise ValueError(
                f"prefix_len: {prefix_len} must be page-aligned and within [0, {len(ids)}]")
        return slots.reshape(-1).to("cpu", torch.int64)

    def _insert_req(self, ids: list[int], slots: torch.Tensor, prefix_len: int,
                    namespace: Hashable | None) -> int:
        """Insert a request's aligned KV and free its duplicates; returns aligned_len."""
        aligned = len(ids) // self.page_size * self.page_size
        present = self.insert(ids[:aligned], slots[:aligned], namespace)
        if present < prefix_len:
            # The request's locked prefix must still be in the tree under these ids.
            raise RuntimeError(
                f"prefix_len: tree holds {present} tokens of a request that borrowed {prefix_len}"
                f" (wrong namespace or token ids?)")
        self.allocator.free(slots[prefix_len:present])
        return aligned

    def cache_finished_req(self, token_ids: Sequence[int] | torch.Tensor, slots: torch.Tensor,
                           prefix_len: int, last_node: TreeNode | None,
                           namespace: Hashable | None = None) -> None:
        """Hand a finished request's KV to the tree; afterwards the request owns nothing.

        `token_ids` are the tokens whose KV is in `slots` (same length), `prefix_len` and
        `last_node` what the request borrowed (from match or cache_unfinished_req; None or a
        root when it borrowed nothing).
        """
        ids = token_list(token_ids)
        slots = self._check_req(ids, slots, prefix_len)
        if self.disable:
            self.allocator.free(slots[prefix_len:])
        else:
            aligned = self._insert_req(ids, slots, prefix_len, namespace)
            self.allocator.free(slots[aligned:])  # the unaligned tail page
        self.dec_lock_ref(last_node)

    def cache_unfinished_req(
        self, token_ids: Sequence[int] | torch.Tensor, slots: torch.Tensor, prefix_len: int,
        last_node: TreeNode | None, namespace: Hashable | None = None,
    ) -> tuple[torch.Tensor, TreeNode | None, int]:
        """Cache a running request's aligned KV (chunked prefill) and re-borrow it from the tree.

        Returns (slots_now, new_last_node, new_prefix_len): the request must use slots_now
        (the tree's slots for [0, new_prefix_len) plus its own unaligned tail) from now on,
        e.g. rewrite its req_to_token row, and owns only [new_prefix_len, len) afterwards.
        The lock moves from `last_node` to `new_last_node`.
        """
        ids = token_list(token_ids)
        slots = self._check_req(ids, slots, prefix_len)
        if self.disable:
            return slots, last_node, prefix_len
        aligned = self._insert_req(ids, slots, prefix_len, namespace)
        match = self.match_prefix(ids[:aligned], namespace)
        if match.prefix_len != aligned:
            raise RuntimeError(f"cache_unfinished_req: re-match found {match.prefix_len} of "
                               f"{aligned} tokens just inserted")
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(last_node)
        return torch.cat([match.slots, slots[aligned:]]), match.last_node, aligned

    # ---- eviction ---------------------------------------------------------------------------

    def _free_nodes(self, nodes: list[TreeNode]) -> None:
        """Return the pages of nodes leaving the tree, in one allocator call."""
        if nodes:
            first_slots = torch.cat([n.value[:: self.page_size] for n in nodes])
            self.allocator.free_pages(torch.div(first_slots, self.page_size, rounding_mode="floor"))

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until `num_tokens` are freed or
        nothing evictable is left; returns the number of tokens freed (whole pages)."""
        if num_tokens <= 0 or self.disable:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self.nodes()
                if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed, evicted = 0, []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            evicted.append(node)
            freed += len(node.key)
            self._evictable_tokens -= len(node.key)
            parent = node.parent
            if parent is None:
                raise RuntimeError("evict: a root reached the eviction heap")
            del parent.children[tuple(node.key[: self.page_size])]
            node.parent = None  # detached: holds no pages any more
            if not parent.is_root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self._free_nodes(evicted)
        return freed

    # ---- debugging --------------------------------------------------------------------------

    def pretty_print(self) -> str:
        """The tree as indented text, one node a line (also handy in assertion messages)."""
        head = (f"RadixCache(page_size={self.page_size}, evictable={self._evictable_tokens}, "
                f"protected={self._protected_tokens})")
        return format_tree(head, self._roots, self.page_size)
