"""The nixl backend's guards, with real NIXL agents: a forged notification naming pages the room
did not register fails the room and tells prefill; a WRITE outside decode's registered pool is
refused by NIXL itself and by the sender's bounds check; a last chunk without pages travels as
a notification alone; timeouts fail rooms as for the other backends."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
import torch

from pdserve.bench.kv_peer import PeerProcess, PoolSpec, make_pool, page_checksum, wait_for
from pdserve.kvtransfer import AuxData, KVManager, KVPoll, TransferConfig
from pdserve.kvtransfer.backends import importable
from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.descriptors import descs

pytestmark = pytest.mark.skipif(not importable("nixl"), reason="nixl is not installed")

CFG = TransferConfig(backend="nixl", heartbeat_interval_s=0.2, heartbeat_misses=5)
SPEC = PoolSpec(num_pages=32, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def prefill():  # type: ignore[no-untyped-def]
    peer = PeerProcess("prefill", PoolSpec(**{**SPEC.__dict__, "seed": 9}), CFG)
    yield peer
    assert peer.close() == []


@pytest.fixture
def decode():  # type: ignore[no-untyped-def]
    pool, _ = make_pool(SPEC)
    mgr = KVManager("decode", pool, CFG, SPEC.fingerprint())
    yield mgr, pool
    mgr.close()
    assert mgr.registered_regions() == []


def _registered(mgr: KVManager, prefill: PeerProcess, room: int, pages: list[int]):  # type: ignore[no-untyped-def]
    r = mgr.create_receiver(room, prefill.bootstrap_addr)
    prefill.call("create_sender", room)
    r.init(pages)
    assert wait_for(r, KVPoll.WaitingForInput) == KVPoll.WaitingForInput, r.failure_reason
    return r


def test_pages_then_an_empty_last_chunk(decode, prefill: PeerProcess) -> None:  # type: ignore
    mgr, pool = decode
    src, dst = [3, 4, 5, 20, 9], [10, 11, 12, 30, 1]
    r = _registered(mgr, prefill, 41, dst)
    prefill.call("send", 41, src, 0, False, None)
    assert wait_for(r, KVPoll.Transferring) == KVPoll.Transferring
    prefill.call("send", 41, [], 5, True, (17, -0.75, 4))  # only the header travels
    assert wait_for(r, KVPoll.Success) == KVPoll.Success, r.failure_reason
    assert r.aux == AuxData(17, -0.75, 4)
    assert page_checksum(pool, dst) == prefill.call("checksum", src)


def test_forged_notification_and_writes_outside_the_pool(decode, prefill: PeerProcess) -> None:  # type: ignore
    from pdserve.kvtransfer.backends.nixl_lib import NotifPoller, new_agent

    mgr, pool = decode
    info = mgr._decode.engines._info["nixl"]  # type: ignore[union-attr]
    forger = new_agent("forger")
    poller = NotifPoller(forger, lambda msg: None)  # the agent's UCX worker needs progress
    src = torch.ones(4, SPEC.page_bytes, dtype=torch.uint8)
    reg = forger.register_memory(src)
    try:
        name = forger.add_remote_agent(base64.b64decode(info["md"]))
        r = _registered(mgr, prefill, 77, [4, 5, 6])
        # A notification for page 9, which room 77 never registered.
        forger.send_notif(name, ChunkHeader(77, 0, descs([(1, 9, 1, 0)]), False, None)
                          .to_bytes())
        assert wait_for(r, KVPoll.Success) == KVPoll.Failed
        assert "not registered" in (r.failure_reason or "")
        st, reason = prefill.call("wait", 77, int(KVPoll.Success), 5)
        assert st == KVPoll.Failed and "rejected" in reason
        # One byte past decode's registered pool: NIXL refuses to build the transfer.
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


def test_sender_bounds_check_before_nixl(decode) -> None:  # type: ignore
    from pdserve.kvtransfer.backends import make_engine

    mgr, pool = decode
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


def test_timeouts_fail_rooms() -> None:
    cfg = TransferConfig(backend="nixl", bootstrap_timeout_s=0.3, waiting_timeout_s=0.3)
    pool, _ = make_pool(SPEC)
    pmgr = KVManager("prefill", pool, cfg, SPEC.fingerprint())
    dmgr = KVManager("decode", pool.clone(), cfg, SPEC.fingerprint())
    try:
        s = pmgr.create_sender(1)  # decode never registers
        assert wait_for(s, KVPoll.Success, 3) == KVPoll.Failed
        assert "bootstrap timeout" in (s.failure_reason or "")
        r = dmgr.create_receiver(2, pmgr.bootstrap_addr)  # prefill never creates room 2
        r.init([1])
        assert wait_for(r, KVPoll.Success, 3) == KVPoll.Failed
        assert "waiting timeout" in (r.failure_reason or "")
    finally:
        pmgr.close()
        dmgr.close()
    assert pmgr.registered_regions() == [] and dmgr.registered_regions() == []
