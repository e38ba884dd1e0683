"""Which part of a Llama-family model each tensor-parallel rank holds.

Attention is split by heads: rank r holds query heads [r * H/N, (r+1) * H/N) and the KV heads
they read. With at least as many KV heads as ranks, the KV heads are split evenly; with fewer,
each KV head is replicated on the N/KV ranks whose query heads share it (a rank then holds one).
The MLP is split by intermediate columns, the vocabulary (embedding and output head) by rows,
padded to a multiple of N so every rank's slice has the same shape (the all-gather of logits
needs that); padded rows are zero and their logits are cut off after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import ModelConfig


def check_tp(cfg: ModelConfig, size: int) -> None:
    """ValueError (naming `tp` and the model field) when `cfg` cannot be split over `size`."""
    if size < 1:
        raise ValueError(f"tp: must be at least 1, got {size}")
    if cfg.num_heads % size:
        raise ValueError(f"tp: {size} ranks do not divide num_heads {cfg.num_heads} "
                         f"of {cfg.name}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tp: {size} ranks and num_kv_heads {kv} of {cfg.name}: one must "
                         "divide the other (KV heads are split, or replicated)")
    if cfg.intermediate_size % size:
        raise ValueError(f"tp: {size} ranks do not divide intermediate_size "
                         f"{cfg.intermediate_size} of {cfg.name}")


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: the heads, MLP columns and vocabulary rows it holds."""

    size: int
    rank: int
    head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    kv_replicas: int  # ranks holding each of this rank's KV heads (1: split, not replicated)
    intermediate_start: int
    intermediate_size: int
    vocab_start: int
    vocab_len: int  # real vocabulary rows held (the last rank's slice may be short)
    vocab_per_rank: int  # rows of every rank's embedding / head shard, padding included

    @classmethod
    def of(cls, cfg: ModelConfig, size: int = 1, rank: int = 0) -> TPShard:
        check_tp(cfg, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank: must be in [0, {size}), got {rank}")
        heads = cfg.num_heads // size
        kv_start, kv_heads = kv_heads_of(cfg.num_kv_heads, size, rank)
        inter = cfg.intermediate_size // size
        per_rank = -(-cfg.vocab_size // size)
        vocab_start = min(rank * per_rank, cfg.vocab_size)
        vocab_len = min(per_rank, cfg.vocab_size - vocab_start)
        replicas = max(1, size // cfg.num_kv_heads)
        return cls(size, rank, rank * heads, heads, kv_start, kv_heads, replicas, rank * inter,
                   inter, vocab_start, vocab_len, per_rank)


def kv_heads_of(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) that rank `rank` of `size` holds."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, per
    return rank * num_kv_heads // size, 1
