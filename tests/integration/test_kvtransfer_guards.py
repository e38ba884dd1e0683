"""Guards between two real processes: forged or out-of-range indices are rejected and never
written, a fingerprint mismatch is refused naming the field, timeouts fail rooms, late messages
are dropped. The same for the one-sided nixl backend, with real NIXL agents: a forged
notification naming pages the room did not register fails the room and tells prefill; a WRITE
outside decode's registered pool is refused by NIXL itself and by the sender's bounds check; a
last chunk without pages travels as a notification alone."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
import torch

from pdserve.bench.kv_peer import PeerProcess, PoolSpec, make_pool, page_checksum, wait_for
from pdserve.kvtransfer import AuxData, KVManager, KVPoll, TransferConfig
from pdserve.kvtransfer.backends import importable, make_engine
from pdserve.kvtransfer.backends.tcp import TcpEngine
from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.descriptors import descs

CFG = TransferConfig(backend="tcp", heartbeat_interval_s=0.2, heartbeat_misses=3)
NIXL = TransferConfig(backend="nixl", heartbeat_interval_s=0.2, heartbeat_misses=5)
SPEC = PoolSpec(num_pages=32, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8)
needs_nixl = pytest.mark.skipif(not importable("nixl"), reason="nixl is not installed")


def _prefill_peer(cfg: TransferConfig):  # type: ignore[no-untyped-def]
    peer = PeerProcess("prefill", PoolSpec(**{**SPEC.__dict__, "seed": 9}), cfg)
    yield peer
    assert peer.close() == []


@pytest.fixture(scope="module")
def prefill():  # type: ignore[no-untyped-def]
    yield from _prefill_peer(CFG)


@pytest.fixture(scope="module")
def nixl_prefill():  # type: ignore[no-untyped-def]
    yield from _prefill_peer(NIXL)


@pytest.fixture
def nixl_decode():  # type: ignore[no-untyped-def]
    pool, _ = make_pool(SPEC)
    mgr = KVManager("decode", pool, NIXL, SPEC.fingerprint())
    yield mgr, pool
    mgr.close()
    assert mgr.registered_regions() == []


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


@pytest.mark.parametrize("backend", ["tcp", pytest.param("nixl", marks=needs_nixl)])
def test_timeouts_fail_rooms(backend: str) -> None:
    cfg = TransferConfig(backend=backend, bootstrap_timeout_s=0.3, waiting_timeout_s=0.3)
    pool, _ = make_pool(SPEC)
    pmgr = KVManager("prefill", pool, cfg, SPEC.fingerprint())
    dmgr = KVManager("decode", pool.clone(), cfg, SPEC.fingerprint())
    try:
        s = pmgr.create_sender(1)  # decode never registers
        assert wait_for(s, KVPoll.Success, 3) == KVPoll.Failed
        assert "bootstrap timeout" in (s.failure_reason or "")
        r = dmgr.create_receiver(2, pmgr.bootstrap_addr)  # registered; prefill has no room
        r.init([1])
        assert wait_for(r, KVPoll.Success, 3) == KVPoll.Failed
        assert "waiting timeout" in (r.failure_reason or "")
    finally:
        pmgr.close()
        dmgr.close()
    assert pmgr.registered_regions() == [] and dmgr.registered_regions() == []


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


def _registered(mgr: KVManager, prefill: PeerProcess, room: int, pages: list[int]):  # type: ignore[no-untyped-def]
    r = mgr.create_receiver(room, prefill.bootstrap_addr)
    prefill.call("create_sender", room)
    r.init(pages)
    assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput, r.failure_reason
    # Prefill learns of the pages by a message of its own: a sender sends only once it has them
    # (as the prefill scheduler waits for it), else send() refuses.
    st, reason = prefill.call("wait", room, int(KVPoll.WaitingForInput), 10)
    assert st == KVPoll.WaitingForInput, reason
    return r


@needs_nixl
def test_nixl_pages_then_an_empty_last_chunk(nixl_decode, nixl_prefill: PeerProcess) -> None:  # type: ignore
    mgr, pool = nixl_decode
    src, dst = [3, 4, 5, 20, 9], [10, 11, 12, 30, 1]
    r = _registered(mgr, nixl_prefill, 41, dst)
    nixl_prefill.call("send", 41, src, 0, False, None)
    assert wait_for(r, KVPoll.Transferring) == KVPoll.Transferring
    nixl_prefill.call("send", 41, [], 5, True, (17, -0.75, 4))  # only the header travels
    assert wait_for(r, KVPoll.Success) == KVPoll.Success, r.failure_reason
    assert r.aux == AuxData(17, -0.75, 4)
    assert page_checksum(pool, dst) == nixl_prefill.call("checksum", src)


@needs_nixl
def test_nixl_forged_notification_and_writes_outside_the_pool(  # type: ignore[no-untyped-def]
        nixl_decode, nixl_prefill: PeerProcess) -> None:
    from pdserve.kvtransfer.backends.nixl_lib import NotifPoller, new_agent

    mgr, pool = nixl_decode
    info = mgr._decode.engines._info["nixl"]  # type: ignore[union-attr]
    forger = new_agent("forger")
    poller = NotifPoller(forger, lambda msg: None)  # the agent's UCX worker needs progress
    src = torch.ones(4, SPEC.page_bytes, dtype=torch.uint8)
    reg = forger.register_memory(src)
    try:
        name = forger.add_remote_agent(base64.b64decode(info["md"]))
        r = _registered(mgr, nixl_prefill, 77, [4, 5, 6])
        # A notification for page 9, which room 77 never registered.
        forger.send_notif(name, ChunkHeader(77, 0, descs([(1, 9, 1, 0)]), False, None)
                          .to_bytes())
        assert wait_for(r, KVPoll.Success) == KVPoll.Failed
        assert "not registered" in (r.failure_reason or "")
        st, reason = nixl_prefill.call("wait", 77, int(KVPoll.Success), 5)
        assert st == KVPoll.Failed and "rejected" in reason
        # Ending one byte past decode's registered pool: NIXL refuses to build the transfer.
        end = int(info["base"]) + pool.numel() * pool.element_size()
        local = np.array([(src.data_ptr(), 64, 0)], dtype=np.uint64)
        far = np.array([(end - 63, 64, 0)], dtype=np.uint64)
        with pytest.raises(Exception, match="NOT_FOUND"):
            forger.initialize_xfer("WRITE", forger.get_xfer_descs(local, "DRAM"),
                                   forger.get_xfer_descs(far, "DRAM"), name, b"")
        time.sleep(0.1)
        assert not pool.view(torch.int16).any()
    finally:
        poller.close()
        forger.deregister_memory(reg)


@needs_nixl
def test_nixl_sender_checks_bounds_before_writing(nixl_decode) -> None:  # type: ignore
    mgr, pool = nixl_decode
    info = dict(mgr._decode.engines._info["nixl"])  # type: ignore[union-attr]
    eng = make_engine("nixl")
    try:
        eng.register("kv", torch.ones(SPEC.shape, dtype=torch.bfloat16))
        for bad in ([(1, 31, 2, 0)], [(1, 0, 1, 0)]):  # past the end; the reserved page 0
            with pytest.raises(ValueError, match="outside the pool of peer"):
                eng.write("p", info, ChunkHeader(1, 0, descs(bad), False, None))
        with pytest.raises(ValueError, match="page_bytes"):
            eng.connect("q", {**info, "page_bytes": 8})
    finally:
        eng.close()
    assert not pool.view(torch.int16).any()
