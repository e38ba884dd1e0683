"""kvtransfer building blocks: config validation, fingerprint, descriptors, KVPoll state,
aux slots, shared-memory pool, page gather/scatter."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kernels.page_copy import gather_pages, scatter_pages
from pdserve.kvtransfer import AuxData, Fingerprint, FingerprintMismatch, KVPoll, TransferConfig
from pdserve.kvtransfer.aux import AuxSlots
from pdserve.kvtransfer.descriptors import Descriptor, merge_runs, validate_dst
from pdserve.kvtransfer.engine import ChunkHeader
from pdserve.kvtransfer.poll import RoomState
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer, alloc_shm_pool


@pytest.mark.parametrize(("field", "value"), [
    ("backend", "rdma"), ("bootstrap_port", 70000), ("bootstrap_timeout_s", 0),
    ("heartbeat_misses", 0), ("num_aux_slots", 0), ("transfer_timeout_s", -1.0)])
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
    descs = merge_runs([5, 6, 7, 9, 10], [1, 2, 8, 9, 10], pos=4)
    assert [d.to_list() for d in descs] == [[5, 1, 2, 4], [7, 8, 1, 6], [9, 9, 2, 7]]
    assert len(merge_runs(list(range(1, 11)), list(range(11, 21)), max_pages=4)) == 3


@given(st.lists(st.integers(1, 200), min_size=1, max_size=40, unique=True),
       st.integers(0, 5))
def test_merge_runs_covers_every_page_once(pages: list[int], shift: int) -> None:
    dst = [p + shift for p in sorted(pages)]
    descs = merge_runs(pages, dst)
    flat = [(d.src_page + k, d.dst_page + k, d.pos + k) for d in descs for k in range(d.num_pages)]
    assert flat == [(s, t, i) for i, (s, t) in enumerate(zip(pages, dst))]
    assert validate_dst(descs, dst, 300) is None


def test_validate_dst_rejects_unregistered_and_out_of_pool() -> None:
    reg = [4, 5, 6]
    assert validate_dst([Descriptor(1, 4, 3, 0)], reg, 10) is None
    assert "not registered" in validate_dst([Descriptor(1, 5, 1, 0)], reg, 10)  # type: ignore
    assert "outside the 3 pages" in validate_dst([Descriptor(1, 5, 3, 1)], reg, 10)  # type: ignore
    assert "outside pool" in validate_dst([Descriptor(1, 0, 1, 0)], [0], 10)  # type: ignore
    assert "outside pool" in validate_dst([Descriptor(1, 9, 2, 0)], [9, 10], 10)  # type: ignore


def test_room_state_is_monotonic_and_failed_overrides() -> None:
    s = RoomState(1)
    assert s.status == KVPoll.Bootstrapping
    assert s.advance(KVPoll.Transferring) and not s.advance(KVPoll.WaitingForInput)
    assert s.fail("x") and s.status == KVPoll.Failed and s.failure_reason == "x"
    assert not s.advance(KVPoll.Success) and not s.fail("y") and s.failure_reason == "x"
    t = RoomState(2)
    assert t.advance(KVPoll.Success) and not t.fail("late") and t.status == KVPoll.Success


def test_chunk_header_roundtrip_and_aux_slots() -> None:
    h = ChunkHeader(2**62 + 3, 1, (Descriptor(1, 2, 3, 0),), True, AuxData(7, -1.5, 9))
    assert ChunkHeader.from_bytes(h.to_bytes()) == h
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
