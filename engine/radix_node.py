"""Nodes of the page-aligned radix tree (engine/radix_cache.py) and the match result.

A node's `key` is a run of token ids whose length is a multiple of page_size, and its `value`
the KV slots of those tokens (same length, whole pages). Children are keyed by the first page
of their key, so siblings never share a first page. A node owns the pages of its `value` while
it is in the tree.

lock_ref rule: `lock_ref` counts the live requests whose matched prefix passes through the node.
Locking a node locks every ancestor up to its root, so an unlocked node has an unlocked
subtree, and only nodes with lock_ref == 0 may be evicted.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch


class TreeNode:
    """One edge of the radix tree. Roots have an empty key and no parent."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "namespace", "node_id", "parent",
                 "value")

    def __init__(
        self,
        key: list[int],
        value: torch.Tensor,
        parent: TreeNode | None,
        node_id: int,
        namespace: Hashable | None,
        last_access: int = 0,
    ) -> None:
        self.key = key
        self.value = value
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access  # a per-cache logical clock: larger = more recent
        self.node_id = node_id
        self.namespace = namespace

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.node_id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")


@dataclass(frozen=True)
class MatchResult:
    """Longest cached page-aligned prefix: its slots (owned by the tree) and its last node.

    `last_node` is the node to pass to `inc_lock_ref` / `cache_*_req`; it is the namespace's
    root when nothing matched (locking a root is a no-op).
    """

    slots: torch.Tensor
    last_node: TreeNode

    @property
    def prefix_len(self) -> int:
        return self.slots.numel()


def format_tree(head: str, roots: Mapping[Hashable, TreeNode], page_size: int) -> str:
    """Indented text of every namespace's tree: id, length, lock_ref, access time, key, pages."""
    lines = [head]
    for namespace, root in roots.items():
        lines.append(f"ns={namespace!r}")
        stack = [(child, 1) for child in root.children.values()]
        while stack:
            node, depth = stack.pop()
            more = "..." if len(node.key) > 8 else ""
            pages = torch.div(node.value[::page_size], page_size, rounding_mode="floor").tolist()
            lines.append(f"{'  ' * depth}#{node.node_id} len={len(node.key)} "
                         f"lock={node.lock_ref} t={node.last_access} key={node.key[:8]}{more} "
                         f"pages={pages}")
            stack.extend((c, depth + 1) for c in node.children.values())
    return "\n".join(lines)


def match_len(key: list[int], ids: list[int], start: int, end: int, page_size: int) -> int:
    """Page-aligned common prefix length of `key` and ids[start:end] (both page-aligned); the
    first page is known to match (it is the child's dict key)."""
    n = min(len(key), end - start)
    if key[:n] == ids[start:start + n]:
        return n
    i = page_size
    while i + page_size <= n and key[i:i + page_size] == ids[start + i:start + i + page_size]:
        i += page_size
    return i


def split_node(child: TreeNode, split_len: int, page_size: int, node_id: int) -> TreeNode:
    """Cut `child` at page boundary `split_len`; returns the new upper part.

    The upper part inherits lock_ref (every lock through `child` passes through it) and the
    access time, so lock and LRU accounting are unchanged by a split.
    """
    parent = child.parent
    if parent is None:
        raise RuntimeError("split: roots are never split")
    upper = TreeNode(child.key[:split_len], child.value[:split_len], parent, node_id,
                     child.namespace, child.last_access)
    upper.lock_ref = child.lock_ref
    parent.children[tuple(child.key[:page_size])] = upper
    child.key = child.key[split_len:]
    child.value = child.value[split_len:]
    child.parent = upper
    upper.children[tuple(child.key[:page_size])] = child
    return upper


def check_whole_pages(slots: torch.Tensor, page_size: int) -> None:
    """Each run of page_size slots must be one whole page, offsets in order."""
    rows = slots.view(-1, page_size)
    pages = torch.div(rows, page_size, rounding_mode="floor")
    if bool((rows % page_size != torch.arange(page_size)).any()) or bool(
            (pages != pages[:, :1]).any()):
        raise ValueError("slots: page-aligned token runs must fill whole pages in order")


def token_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
