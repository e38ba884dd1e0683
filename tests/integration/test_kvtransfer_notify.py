"""One-sided shm transfers are counted whichever way the chunk notification travels: straight
from prefill's transfer thread over the same-host socket, or (a peer that cannot reach that
socket) over the control channel."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.kv_peer import PoolSpec, make_pool, wait_for
from pdserve.kvtransfer import AuxData, KVManager, KVPoll, TransferConfig

SPEC = PoolSpec(num_pages=40, num_layers=3, page_size=4, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("direct", [True, False], ids=["socket", "control"])
def test_shm_chunks_counted_over_either_channel(direct: bool) -> None:
    cfg = TransferConfig(backend="shm")
    src_pool, _ = make_pool(PoolSpec(**{**SPEC.__dict__, "seed": 4}))
    dst_pool, shm = make_pool(PoolSpec(**{**SPEC.__dict__, "shm": True}))
    pmgr = KVManager("prefill", src_pool, cfg, SPEC.fingerprint())
    dmgr = KVManager("decode", shm, cfg, SPEC.fingerprint())  # type: ignore[arg-type]
    try:
        if not direct:  # as if prefill could not reach the socket: decode does not offer it
            dmgr._decode.engines._info["shm"].pop("notify")  # type: ignore[union-attr]
        src, dst = [3, 4, 5, 30, 9, 10, 11, 12, 13, 2], [20, 21, 22, 7, 8, 1, 2, 3, 4, 39]
        s = pmgr.create_sender(7)
        r = dmgr.create_receiver(7, pmgr.bootstrap_addr)
        r.init(dst)
        assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        s.send(src[:4], 0, False)
        s.send(torch.tensor(src[4:]), 4, True, AuxData(11, -0.5, 2))
        assert wait_for(r, KVPoll.Success) == KVPoll.Success, r.failure_reason
        assert wait_for(s, KVPoll.Success) == KVPoll.Success, s.failure_reason
        assert torch.equal(dst_pool[dst].view(torch.int16), src_pool[src].view(torch.int16))
        assert r.aux == AuxData(11, -0.5, 2)
        socks = pmgr._prefill.xfer.engine("shm")._notifier._socks  # type: ignore
        assert bool(socks) == direct  # one decode peer: its socket, or none
    finally:
        pmgr.close()
        dmgr.close()
        assert shm is not None
        shm.close()
    assert pmgr.registered_regions() == [] and dmgr.registered_regions() == []


def test_each_side_wakes_its_scheduler_when_a_room_moves() -> None:
    """The worker's scheduler sleeps between idle polls; every status a room enters (on the
    control, transfer or receiving threads) calls the manager's wake hook."""
    cfg = TransferConfig(backend="shm")
    src_pool, _ = make_pool(PoolSpec(**{**SPEC.__dict__, "seed": 5}))
    dst_pool, shm = make_pool(PoolSpec(**{**SPEC.__dict__, "shm": True}))
    pmgr = KVManager("prefill", src_pool, cfg, SPEC.fingerprint())
    dmgr = KVManager("decode", shm, cfg, SPEC.fingerprint())  # type: ignore[arg-type]
    woke: dict[str, list[KVPoll]] = {"prefill": [], "decode": []}
    rooms: dict[str, object] = {}
    pmgr.wake_on_change(lambda: woke["prefill"].append(rooms["prefill"].poll()))
    dmgr.wake_on_change(lambda: woke["decode"].append(rooms["decode"].poll()))
    try:
        s = rooms["prefill"] = pmgr.create_sender(8)
        r = rooms["decode"] = dmgr.create_receiver(8, pmgr.bootstrap_addr)
        r.init([1, 2])
        assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        s.send([5, 6], 0, True, AuxData(3, 0.0, 0))
        assert wait_for(r, KVPoll.Success) == KVPoll.Success, r.failure_reason
        assert wait_for(s, KVPoll.Success) == KVPoll.Success, s.failure_reason
        assert woke["prefill"][0] == KVPoll.WaitingForInput
        assert woke["prefill"][-1] == KVPoll.Success and woke["decode"][-1] == KVPoll.Success
        failing = rooms["decode"] = dmgr.create_receiver(9, pmgr.bootstrap_addr)
        failing.abort("client gone")
        assert woke["decode"][-1] == KVPoll.Failed
    finally:
        pmgr.close()
        dmgr.close()
        assert shm is not None
        shm.close()
