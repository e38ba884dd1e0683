"""Guards between two real processes: forged or out-of-range indices are rejected and never
written, a fingerprint mismatch is refused naming the field, timeouts fail rooms, late messages
are dropped."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.bench.kv_peer import PeerProcess, PoolSpec, make_pool, wait_for
from pdserve.kvtransfer import KVManager, KVPoll, TransferConfig
from pdserve.kvtransfer.backends.tcp import TcpEngine
from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.descriptors import descs

CFG = TransferConfig(backend="tcp", heartbeat_interval_s=0.2, heartbeat_misses=3)
SPEC = PoolSpec(num_pages=32, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def prefill():  # type: ignore[no-untyped-def]
    peer = PeerProcess("prefill", PoolSpec(**{**SPEC.__dict__, "seed": 9}), CFG)
    yield peer
    assert peer.close() == []


def _forge(addr: str, header: ChunkHeader, page_bytes: int, pages: int) -> None:
    eng = TcpEngine()
    try:
        eng.register("kv", torch.ones(32, page_bytes, dtype=torch.uint8))
        eng.write("forger", {"addr": addr}, header)
        time.sleep(0.2)  # closing drops unsent messages (LINGER 0)
    finally:
        eng.close()
    del pages


def test_forged_destination_is_rejected_and_never_written(prefill: PeerProcess) -> None:
    pool, _ = make_pool(SPEC)
    dmgr = KVManager("decode", pool, CFG, SPEC.fingerprint())
    try:
        addr = dmgr._decode.engines._info["tcp"]["addr"]  # type: ignore[union-attr]
        r = dmgr.create_receiver(77, prefill.bootstrap_addr)
        prefill.call("create_sender", 77)
        r.init([4, 5, 6])
        assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        pb = SPEC.page_bytes
        # Page 9 was never registered for room 77.
        _forge(addr, ChunkHeader(77, 0, descs([(1, 9, 1, 0)]), False, None), pb, 1)
        assert wait_for(r, KVPoll.Success) == KVPoll.Failed
        assert "not registered" in (r.failure_reason or "")
        assert not pool[9].view(torch.int16).any() and not pool[4].view(torch.int16).any()
        st, reason = prefill.call("wait", 77, int(KVPoll.Success), 5)
        assert st == KVPoll.Failed and "rejected" in reason
        # A size that does not match the pages it claims.
        r2 = dmgr.create_receiver(78, prefill.bootstrap_addr)
        prefill.call("create_sender", 78)
        r2.init([10, 11])
        assert wait_for(r2, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        _forge(addr, ChunkHeader(78, 0, descs([(1, 10, 2, 0)]), False, None), pb // 2, 1)
        assert wait_for(r2, KVPoll.Success) == KVPoll.Failed
        assert "size" in (r2.failure_reason or "")
        assert not pool[10:12].view(torch.int16).any()
        # Out of the pool, and late messages for a finished room: dropped, nothing written.
        _forge(addr, ChunkHeader(78, 1, descs([(1, 10, 2, 0)]), False, None), pb, 1)
        _forge(addr, ChunkHeader(99, 0, descs([(1, 12, 1, 0)]), False, None), pb, 1)
        time.sleep(0.2)
        assert not pool[10:13].view(torch.int16).any()
        with pytest.raises(ValueError, match="outside pool"):
            dmgr.create_receiver(79, prefill.bootstrap_addr).init([5, 32])
    finally:
        dmgr.close()


def test_sender_rejects_out_of_range_pages() -> None:
    spec = PoolSpec(**{**SPEC.__dict__, "seed": 3})
    decode = PeerProcess("decode", SPEC, CFG)
    pool, _ = make_pool(spec)
    pmgr = KVManager("prefill", pool, CFG, spec.fingerprint())
    try:
        s = pmgr.create_sender(5)
        decode.call("create_receiver", 5, pmgr.bootstrap_addr)
        decode.call("init", 5, [1, 2])
        assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        with pytest.raises(ValueError, match="exceed the 2 pages"):
            s.send([3, 4, 5], 0, True)
        assert s.poll() == KVPoll.Failed
        st, reason = decode.call("wait", 5, int(KVPoll.Success), 5)
        assert st == KVPoll.Failed and "exceed" in reason
        assert decode.call("checksum", [1, 2]) == decode.call("checksum", [20, 21])  # zeros
    finally:
        pmgr.close()
        assert decode.close() == []


def test_fingerprint_mismatch_is_refused_naming_the_field(prefill: PeerProcess) -> None:
    spec = PoolSpec(**{**SPEC.__dict__, "num_layers": 3})
    pool, _ = make_pool(spec)
    dmgr = KVManager("decode", pool, CFG, spec.fingerprint())
    try:
        r = dmgr.create_receiver(11, prefill.bootstrap_addr)
        r.init([1])
        assert wait_for(r, KVPoll.Success) == KVPoll.Failed
        assert "fingerprint mismatch: num_layers" in (r.failure_reason or "")
        assert "prefill has 2" in (r.failure_reason or "")
    finally:
        dmgr.close()


def test_timeouts_fail_rooms(prefill: PeerProcess) -> None:
    cfg = TransferConfig(backend="tcp", bootstrap_timeout_s=0.3, waiting_timeout_s=0.3)
    pool, _ = make_pool(SPEC)
    pmgr = KVManager("prefill", pool, cfg, SPEC.fingerprint())
    dmgr = KVManager("decode", pool.clone(), cfg, SPEC.fingerprint())
    try:
        s = pmgr.create_sender(1)  # decode never registers
        assert wait_for(s, KVPoll.Success, 3) == KVPoll.Failed
        assert "bootstrap timeout" in (s.failure_reason or "")
        r = dmgr.create_receiver(2, prefill.bootstrap_addr)  # registered; prefill has no room
        r.init([1])
        assert wait_for(r, KVPoll.Success, 3) == KVPoll.Failed
        assert "waiting timeout" in (r.failure_reason or "")
    finally:
        pmgr.close()
        dmgr.close()


def test_room_queued_at_prefill_outlives_the_waiting_timeout(prefill: PeerProcess) -> None:
    """A long prefill queue must not fail rooms: heartbeats list the rooms prefill still holds,
    and decode's waiting timeout only runs for rooms prefill no longer lists."""
    cfg = TransferConfig(backend="tcp", waiting_timeout_s=0.3, heartbeat_interval_s=0.05,
                         heartbeat_misses=20)
    pool, _ = make_pool(SPEC)
    dmgr = KVManager("decode", pool, cfg, SPEC.fingerprint())
    try:
        r = dmgr.create_receiver(3, prefill.bootstrap_addr)
        prefill.call("create_sender", 3)
        r.init([1])
        assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        time.sleep(1.2)  # four waiting timeouts
        assert r.poll() == KVPoll.WaitingForInput, r.failure_reason
        r.abort("test done")
    finally:
        dmgr.close()
