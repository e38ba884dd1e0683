"""kvtransfer building blocks: config validation, fingerprint, descriptors, KVPoll state,
aux slots, shared-memory pool, page gather/scatter."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kernels.page_copy import gather_pages, scatter_pages
from pdserve.kvtransfer import AuxData, Fingerprint, FingerprintMismatch, KVPoll, TransferConfig
from pdserve.kvtransfer.aux import AuxSlots
from pdserve.kvtransfer.backends.shm import split_runs
from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.descriptors import check_runs, coalesce, descs, merge_runs, validate_dst
from pdserve.kvtransfer.poll import RoomState
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer, alloc_shm_pool


@pytest.mark.parametrize(("field", "value"), [
    ("backend", "rdma"), ("bootstrap_port", 70000), ("bootstrap_timeout_s", 0),
    ("heartbeat_misses", 0), ("num_aux_slots", 0), ("transfer_timeout_s", -1.0),
    ("ipc_copy", "fast")])
def test_config_names_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TransferConfig(**{field: value})  # type: ignore[arg-type]


def test_fingerprint_mismatch_names_field() -> None:
    a = Fingerprint("m", 30, 3, 64, 16, "bfloat16")
    assert a.mismatch(Fingerprint.from_dict(a.to_dict())) is None
    with pytest.raises(FingerprintMismatch, match="page_size: local has 16, peer has 32"):
        a.check(Fingerprint("m", 30, 3, 64, 32, "bfloat16"))
    with pytest.raises(FingerprintMismatch, match="protocol_version"):
        a.check(Fingerprint("m", 30, 3, 64, 16, "bfloat16", protocol_version=99))
    pool = torch.zeros(4, 30, 2, 16, 3, 64, dtype=torch.bfloat16)
    assert Fingerprint.from_pool_buffer("m", pool) == a


def test_merge_runs_breaks_where_either_side_jumps() -> None:
    d = merge_runs([5, 6, 7, 9, 10], [1, 2, 8, 9, 10], pos=4)
    assert d.tolist() == [[5, 1, 2, 4], [7, 8, 1, 6], [9, 9, 2, 7]]
    capped = merge_runs(list(range(1, 11)), list(range(11, 21)), max_pages=4)
    assert capped.tolist() == [[1, 11, 4, 0], [5, 15, 4, 4], [9, 19, 2, 8]]
    assert coalesce(capped).tolist() == [[1, 11, 10]]  # a copy needs no cap
    assert coalesce(d).tolist() == [[5, 1, 2], [7, 8, 1], [9, 9, 2]]
    assert merge_runs([], []).shape == (0, 4)


@given(st.lists(st.integers(1, 200), min_size=1, max_size=40, unique=True),
       st.integers(0, 5))
def test_merge_runs_covers_every_page_once(pages: list[int], shift: int) -> None:
    dst = [p + shift for p in sorted(pages)]
    for cap in (None, 3):
        d = merge_runs(pages, dst, max_pages=cap)
        flat = [(s + k, t + k, p + k) for s, t, n, p in d.tolist() for k in range(n)]
        assert flat == [(s, t, i) for i, (s, t) in enumerate(zip(pages, dst))]
        assert validate_dst(d, np.array(dst), 300) is None


@given(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 50), st.integers(1, 9)),
                min_size=1, max_size=12), st.integers(1, 3))
def test_split_runs_shares_pages_evenly(runs: list[tuple[int, int, int]], parts: int) -> None:
    pieces = split_runs([list(r) for r in runs], parts)
    flat = [(s + k, d + k) for p in pieces for s, d, n in p for k in range(n)]
    assert flat == [(s + k, d + k) for s, d, n in runs for k in range(n)]
    sizes = [sum(n for _, _, n in p) for p in pieces]
    assert len(pieces) <= parts and max(sizes) - min(sizes) <= -(-sum(sizes) // parts)


def test_validate_dst_rejects_unregistered_and_out_of_pool() -> None:
    reg = np.array([4, 5, 6])

    def why(*rows: tuple[int, int, int, int], registered: np.ndarray = reg) -> str:
        return validate_dst(descs(rows), registered, 10) or ""

    assert validate_dst(descs([(1, 4, 3, 0)]), reg, 10) is None
    assert validate_dst(descs([(1, 4, 1, 0), (7, 6, 1, 2)]), reg, 10) is None
    assert "not registered" in why((1, 5, 1, 0))
    assert "not registered" in why((1, 4, 1, 0), (2, 4, 1, 1))  # the second row is wrong
    assert "outside the 3 pages" in why((1, 5, 3, 1))
    assert "outside the 3 pages" in why((1, 4, 1, -1))
    assert "num_pages <= 0" in why((1, 4, 0, 0))
    assert "num_pages <= 0" in why((1, 4, -2, 2))
    assert "outside pool" in why((1, 0, 1, 0), registered=np.array([0]))
    assert "outside pool" in why((1, 9, 2, 0), registered=np.array([9, 10]))
    assert "cover 4 pages" in why((1, 4, 3, 0), (1, 4, 1, 0))  # more pages than registered
    assert "shape" in (validate_dst(np.zeros((2, 3), dtype=np.int64), reg, 10) or "")


def test_room_state_is_monotonic_and_failed_overrides() -> None:
    s = RoomState(1)
    assert s.status == KVPoll.Bootstrapping
    assert s.advance(KVPoll.Transferring) and not s.advance(KVPoll.WaitingForInput)
    assert s.fail("x") and s.status == KVPoll.Failed and s.failure_reason == "x"
    assert not s.advance(KVPoll.Success) and not s.fail("y") and s.failure_reason == "x"
    t = RoomState(2)
    assert t.advance(KVPoll.Success) and not t.fail("late") and t.status == KVPoll.Success


def test_room_state_reports_each_change_and_only_changes() -> None:
    seen: list[KVPoll] = []
    s = RoomState(3, lambda: seen.append(s.status))
    s.advance(KVPoll.WaitingForInput)
    s.advance(KVPoll.Bootstrapping)  # backwards: no change, no call
    s.advance(KVPoll.WaitingForInput)  # same state: none either
    s.fail("gone")
    s.advance(KVPoll.Success)
    s.fail("again")
    assert seen == [KVPoll.WaitingForInput, KVPoll.Failed]


def test_chunk_header_roundtrip_and_aux_slots() -> None:
    h = ChunkHeader(2**62 + 3, 1, descs([(1, 2, 3, 0), (9, 40, 1, 3)]), True,
                    AuxData(7, -1.5, 9))
    assert ChunkHeader.from_bytes(h.to_bytes()) == h
    assert len(h.to_bytes()) == 48 + 2 * 16  # struct + four int32 per descriptor
    empty = ChunkHeader(5, 0, descs([]), False, None)
    assert ChunkHeader.from_bytes(empty.to_bytes()) == empty
    slots = AuxSlots(2)
    a, b = slots.alloc(), slots.alloc()
    assert slots.alloc() is None and a is not None and b is not None
    slots.write(a, 2**62 + 3, AuxData(7, -1.5, 9))
    assert slots.read(a, 2**62 + 3) == AuxData(7, -1.5, 9)
    assert slots.read(a, 5) is None  # the slot echoes its room
    slots.free(a)
    assert slots.num_free == 1


def test_shm_pool_attach_and_cleanup() -> None:
    with alloc_shm_pool(4, 2, 4, 2, 8, torch.bfloat16) as owner:
        path = f"/dev/shm/{owner.name}"
        assert os.path.exists(path)
        owner.tensor[2].fill_(1.5)
        peer = ShmPoolBuffer(owner.shape, torch.bfloat16, name=owner.name, create=False)
        assert torch.equal(peer.tensor[2], owner.tensor[2])
        peer.tensor[3].fill_(2.0)
        assert float(owner.tensor[3].float().mean()) == 2.0
        peer.close()
        assert os.path.exists(path)  # attaching never unlinks
    assert not os.path.exists(path)


def test_chunk_header_decoding_is_strict() -> None:
    raw = ChunkHeader(3, 0, descs([(1, 2, 3, 0)]), True, AuxData(1, 0.0, 0)).to_bytes()
    for bad, msg in [
        (raw[:-1], "bytes for 1 descriptors"),  # truncated row
        (raw + b"\0" * 16, "bytes for 1 descriptors"),  # a row more than n says
        (raw[:40], "need at least"),
        (b"XXXX" + raw[4:], "magic"),
        (raw[:4] + (1).to_bytes(2, "little") + raw[6:], "protocol version 1"),
        (raw[:6] + bytes([raw[6] | 8]) + raw[7:], "unknown flags"),
        (raw[:6] + bytes([2]) + raw[7:], "not the last"),  # aux without last
        (raw[:20] + (1 << 30).to_bytes(4, "little") + raw[24:], "descriptors"),  # forged n
    ]:
        with pytest.raises(ValueError, match=msg):
            ChunkHeader.from_bytes(bad)
    with pytest.raises(ValueError, match="int32"):
        ChunkHeader(3, 0, descs([(1, 2**31, 1, 0)]), False, None).to_bytes()
    # Forged but well-formed rows decode; the receiver's validate_dst then rejects them.
    forged = ChunkHeader(3, 0, descs([(1, -5, 1, 0)]), False, None)
    back = ChunkHeader.from_bytes(forged.to_bytes())
    assert "outside pool" in (validate_dst(back.descs, np.array([4]), 10) or "")


@given(st.lists(st.integers(1, 30), min_size=1, max_size=12, unique=True))
def test_gather_scatter_match_reference(pages: list[int]) -> None:
    pool = torch.randn(32, 2, 2, 4, 3)
    staging = torch.empty(len(pages) + 2, 2, 2, 4, 3)
    out = gather_pages(pool, pages, staging)
    assert torch.equal(out, pool[pages])
    dst = torch.zeros_like(pool)
    scatter_pages(out, dst, torch.tensor(pages))
    assert torch.equal(dst[pages], pool[pages])
    rest = [p for p in range(32) if p not in pages]
    assert not dst[rest].any()
    with pytest.raises(ValueError, match="out"):
        gather_pages(pool, pages, torch.empty(len(pages), 2, 2, 4, 4))


@pytest.mark.parametrize(("runs", "why"), [
    ([[1, 9, 2]], "destination pages outside the pool of peer p [1, 10)"),
    ([[1, 0, 1]], "destination pages outside"),
    ([[0, 3, 1]], "source pages outside the local pool [1, 8)"),
    ([[7, 3, 2]], "source pages outside"),
])
def test_a_one_sided_sender_refuses_runs_outside_either_pool(runs: list, why: str) -> None:
    check_runs(np.array([[1, 1, 7], [7, 9, 1]]), 10, 8, "p")  # the last page of each: fine
    with pytest.raises(ValueError, match=re.escape(why)):
        check_runs(np.array(runs), 10, 8, "p")
