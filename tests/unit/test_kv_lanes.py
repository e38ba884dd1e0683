"""Tensor-parallel KV layouts: which prefill ranks' heads feed each decode rank (plan_lanes),
the parts of a chunk (staged gathers against whole-KV slices of fresh random pools), and the
layout in the fingerprint (round trip; compared by mapping, not equality)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kvtransfer.descriptors import merge_runs
from pdserve.kvtransfer.fingerprint import Fingerprint
from pdserve.kvtransfer.lanes import KVLayout, PartBuilder, Piece, identity, plan_lanes


def _even(heads: int, tp: int) -> KVLayout:
    if heads >= tp:
        per = heads // tp
        return KVLayout(heads, tuple((r * per, per) for r in range(tp)))
    return KVLayout(heads, tuple((r * heads // tp, 1) for r in range(tp)))


def test_same_layouts_are_direct_lanes() -> None:
    lanes = plan_lanes(_even(8, 2), _even(8, 2))
    assert [(ln.dst_rank, ln.direct) for ln in lanes] == [(0, 0), (1, 1)]
    assert identity(plan_lanes(KVLayout.single(8), KVLayout.single(8)))
    assert not identity(lanes)


def test_split_gather_and_replicated_layouts() -> None:
    # 1 -> 2: each decode rank takes half of the one prefill pool's heads
    lanes = plan_lanes(KVLayout.single(4), _even(4, 2))
    assert [ln.pieces for ln in lanes] == [(Piece(0, 0, 0, 2),), (Piece(0, 2, 0, 2),)]
    assert all(ln.direct is None for ln in lanes)
    # 3 -> 1 (SmolLM2): one head from each prefill rank
    (lane,) = plan_lanes(_even(3, 3), KVLayout.single(3))
    assert lane.pieces == (Piece(0, 0, 0, 1), Piece(1, 0, 1, 1), Piece(2, 0, 2, 1))
    # 4 -> 2 with 2 KV heads: prefill ranks 0,1 and 2,3 hold the same head; rank 0 and 2 read
    lanes = plan_lanes(_even(2, 4), _even(2, 2))
    assert [(ln.direct, ln.pieces) for ln in lanes] == [(0, (Piece(0, 0, 0, 1),)),
                                                         (2, (Piece(2, 0, 0, 1),))]
    # 1 -> 4 with 2 KV heads: decode ranks 0,1 both get head 0
    lanes = plan_lanes(KVLayout.single(2), _even(2, 4))
    assert [ln.pieces[0].src_head for ln in lanes] == [0, 0, 1, 1]
    assert _even(4, 2).describe() == "tp=2 (kv heads 0-1 | 2-3 of 4)"


@pytest.mark.parametrize(("heads", "src_tp", "dst_tp"), [(4, 1, 2), (4, 2, 1), (3, 3, 1),
                                                         (2, 4, 2), (8, 2, 4)])
def test_staged_parts_hold_each_decode_ranks_heads(heads: int, src_tp: int, dst_tp: int) -> None:
    g = torch.Generator().manual_seed(heads * 10 + src_tp)
    whole = torch.randn(20, 2, 2, 4, heads, 8, generator=g)
    src, dst = _even(heads, src_tp), _even(heads, dst_tp)
    pools = [whole[..., s:s + n, :].contiguous() for s, n in src.ranks]
    lanes = plan_lanes(src, dst)
    src_pages = [3, 4, 5, 11, 2, 17]
    descs = merge_runs(np.array(src_pages), np.array([7, 8, 9, 1, 12, 13]))
    for staged in (True, False):
        parts = PartBuilder(pools, lanes).parts(descs, staged=staged)
        for lane in lanes:
            start, n = dst.ranks[lane.dst_rank]
            want = whole[src_pages][..., start:start + n, :]
            got = torch.zeros_like(want)
            for part in (p for p in parts if p.lane == lane.dst_rank):
                assert np.array_equal(part.descs[:, 1:], descs[:, 1:])
                pages = [int(a) + k for a, _, m, _ in part.descs.tolist() for k in range(m)]
                sh, dh, k = part.heads or (0, 0, n)
                got[..., dh:dh + k, :] = part.src[pages][..., sh:sh + k, :]
            assert torch.equal(got, want), (staged, lane)


def test_fingerprint_carries_the_layout() -> None:
    pool = torch.zeros(4, 2, 2, 4, 2, 8)
    fp = Fingerprint.from_pool_buffer("m", pool, _even(4, 2))
    assert (fp.num_kv_heads, fp.kv_ranks) == (4, ((0, 2), (2, 2)))
    assert Fingerprint.from_dict(fp.to_dict()) == fp
    one = Fingerprint.from_pool_buffer("m", torch.zeros(4, 2, 2, 4, 4, 8))
    assert one.kv_ranks == () and one.kv_layout == KVLayout.single(4)
    assert fp.mismatch(one) is None  # mapped at the handshake, not compared
    with pytest.raises(ValueError, match="rank 0 holds 2 KV heads, its pool 3"):
        Fingerprint.from_pool_buffer("m", torch.zeros(4, 2, 2, 4, 3, 8), _even(4, 2))
