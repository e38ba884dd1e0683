"""A room queued at decode (the request waits for decode capacity, no pages registered yet)
outlives both sides' bootstrap deadlines: decode's heartbeats name it to prefill. Once decode
registers its pages the transfer completes; rooms decode does not name still time out."""

from __future__ import annotations

import time

import torch

from pdserve.bench.kv_peer import PoolSpec, make_pool, wait_for
from pdserve.kvtransfer import KVManager, KVPoll, TransferConfig
from pdserve.kvtransfer.aux import AuxData

SPEC = PoolSpec(num_pages=16, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, seed=5)
CFG = TransferConfig(backend="tcp", bootstrap_timeout_s=0.3, heartbeat_interval_s=0.05,
                     heartbeat_misses=20)


def test_room_queued_at_decode_outlives_the_bootstrap_timeouts() -> None:
    src_pool, _ = make_pool(SPEC)
    dst_pool, _ = make_pool(PoolSpec(**{**SPEC.__dict__, "seed": None}))
    pmgr = KVManager("prefill", src_pool, CFG, SPEC.fingerprint())
    dmgr = KVManager("decode", dst_pool, CFG, SPEC.fingerprint())
    try:
        queued = pmgr.create_sender(41)
        forgotten = pmgr.create_sender(42)  # decode never hears of it
        r = dmgr.create_receiver(41, pmgr.bootstrap_addr)
        assert r.queued
        time.sleep(1.2)  # four bootstrap timeouts
        assert queued.poll() == KVPoll.Bootstrapping, queued.failure_reason
        assert r.poll() == KVPoll.Bootstrapping, r.failure_reason
        assert forgotten.poll() == KVPoll.Failed
        assert "bootstrap timeout" in (forgotten.failure_reason or "")
        # Capacity freed: decode registers its pages, and the room is no longer "queued".
        r.init([3, 4])
        assert not r.queued
        assert wait_for(queued, KVPoll.WaitingForInput, 5) == KVPoll.WaitingForInput
        queued.send([7, 9], 0, True, AuxData(11, -0.5, 0))
        assert wait_for(r, KVPoll.Success, 5) == KVPoll.Success, r.failure_reason
        assert wait_for(queued, KVPoll.Success, 5) == KVPoll.Success
        assert torch.equal(dst_pool[[3, 4]].view(torch.int16),
                           src_pool[[7, 9]].view(torch.int16))
        # Once decode stops naming a room (aborted while queued), prefill's deadline runs.
        late = pmgr.create_sender(43)
        dmgr.create_receiver(43, pmgr.bootstrap_addr).abort("client went away")
        assert wait_for(late, KVPoll.Success, 3) == KVPoll.Failed
        assert "bootstrap timeout" in (late.failure_reason or "")
    finally:
        pmgr.close()
        dmgr.close()
