"""`auto` picks the backend by where the peer is, with real managers and real engines: one host
gives shm, two hosts (faked through TransferConfig.host_id) the best cross-host backend this
machine has (nixl, else ucx, else tcp), started on decode only when first chosen; the choice is
logged once per peer; a pinned backend that cannot serve the pair is refused at handshake with
a message naming both hosts."""

from __future__ import annotations

import base64
import logging
import threading

import pytest
import torch

from pdserve.bench.kv_peer import PoolSpec, make_pool, wait_for
from pdserve.kvtransfer import AuxData, KVManager, KVPoll, TransferConfig
from pdserve.kvtransfer.backends import importable

SPEC = PoolSpec(num_pages=40, num_layers=3, page_size=4, num_kv_heads=2, head_dim=8)
HB = {"heartbeat_interval_s": 0.2, "heartbeat_misses": 5}
CROSS_HOST = [n for n in ("nixl", "ucx") if importable(n)] + ["tcp"]


def _pair(prefill_cfg: TransferConfig, decode_cfg: TransferConfig, shm: bool = True):  # type: ignore[no-untyped-def]
    src_pool, _ = make_pool(PoolSpec(**{**SPEC.__dict__, "seed": 6}))
    dst_pool, seg = make_pool(PoolSpec(**{**SPEC.__dict__, "shm": shm}))
    dmgr = KVManager("decode", seg or dst_pool, decode_cfg, SPEC.fingerprint())
    pmgr = KVManager("prefill", src_pool, prefill_cfg, SPEC.fingerprint())
    return pmgr, dmgr, src_pool, dst_pool, seg


def _close(*things: object) -> None:
    for t in things:
        if t is not None:
            t.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["same-host", "two-hosts"])
def test_auto_picks_by_host_and_pages_arrive(where: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.kvtransfer")
    same = where == "same-host"
    dcfg = TransferConfig(host_id="host-d", **HB)  # type: ignore[arg-type]
    pcfg = TransferConfig(host_id="host-d" if same else "host-p", **HB)  # type: ignore[arg-type]
    pmgr, dmgr, src_pool, dst_pool, seg = _pair(pcfg, dcfg)
    expected = "shm" if same else CROSS_HOST[0]
    try:
        assert dmgr.offered_backends == ["shm", *CROSS_HOST]
        running = dmgr._decode.engines  # type: ignore[union-attr]
        assert sorted(running._engines) == ["shm", "tcp"]  # cross-host engines start on demand
        pages = [([3, 4, 5, 30], [20, 21, 22, 7]), ([9, 10, 11, 12, 2], [1, 2, 3, 4, 39])]
        for room, (src, dst) in enumerate(pages, start=1):
            s = pmgr.create_sender(room)
            r = dmgr.create_receiver(room, pmgr.bootstrap_addr)
            r.init(dst)
            assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput, s.failure_reason
            s.send(src[:2], 0, False)
            s.send(src[2:], 2, True, AuxData(room, -0.5, 0))
            assert wait_for(r, KVPoll.Success) == KVPoll.Success, r.failure_reason
            assert wait_for(s, KVPoll.Success) == KVPoll.Success, s.failure_reason
            assert torch.equal(dst_pool[dst].view(torch.int16), src_pool[src].view(torch.int16))
        assert expected in running._engines
        lines = [r.getMessage() for r in caplog.records if "kv transfer with" in r.getMessage()]
        assert len(lines) == 2, lines  # once per peer, on each side, for both rooms
        assert all(line.endswith(f": {expected}") or f": {expected} (" in line
                   for line in lines), lines
        assert all(("same host 'host-d'" if same else
                    "different hosts (prefill 'host-p', decode 'host-d')") in line
                   for line in lines), lines
    finally:
        _close(pmgr, dmgr, seg)
    assert pmgr.registered_regions() == [] and dmgr.registered_regions() == []


@pytest.mark.parametrize("pinned", ["prefill", "decode"])
def test_pinned_shm_across_hosts_is_refused_naming_both_hosts(pinned: str) -> None:
    """shm between two hosts cannot work, whichever side pins it: the handshake is refused and
    the rooms fail with a reason naming both hosts (no page moves, nothing leaks)."""
    pcfg = TransferConfig(backend="shm" if pinned == "prefill" else "auto", host_id="node-p",
                          **HB)  # type: ignore[arg-type]
    dcfg = TransferConfig(backend="shm" if pinned == "decode" else "auto", host_id="node-d",
                          **HB)  # type: ignore[arg-type]
    pmgr, dmgr, _, dst_pool, seg = _pair(pcfg, dcfg)
    try:
        s = pmgr.create_sender(5)
        r = dmgr.create_receiver(5, pmgr.bootstrap_addr)
        r.init([1, 2])
        assert wait_for(r, KVPoll.Success, 5) == KVPoll.Failed
        reason = r.failure_reason or ""
        assert "refused" in reason and "'node-p'" in reason and "'node-d'" in reason, reason
        assert "shm: needs prefill and decode on one host" in reason, reason
        assert s.poll() == KVPoll.Bootstrapping  # the scheduler's bootstrap timeout ends it
        s.abort("test done")
        assert not dst_pool.view(torch.int16).any()
    finally:
        _close(pmgr, dmgr, seg)
    assert pmgr.registered_regions() == [] and dmgr.registered_regions() == []


def test_a_pinned_backend_this_process_cannot_run_is_a_config_error() -> None:
    pool, _ = make_pool(SPEC)
    with pytest.raises(ValueError, match="backend: 'cuda_ipc' needs the pool on a GPU"):
        KVManager("decode", pool, TransferConfig(backend="cuda_ipc"), SPEC.fingerprint())
    with pytest.raises(ValueError, match="backend: 'shm' needs the decode pool in shared"):
        KVManager("decode", pool, TransferConfig(backend="shm"), SPEC.fingerprint())


@pytest.mark.skipif(not importable("nixl"), reason="nixl is not installed")
def test_a_connection_that_fails_is_chosen_around_or_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    """Decode's NIXL metadata is corrupted after its engine started, so prefill's connection
    genuinely fails at handshake: in auto prefill moves on to the next backend (started on
    decode on demand); pinned to nixl it refuses, naming both hosts and the error."""
    caplog.set_level(logging.INFO, logger="pdserve.kvtransfer")
    for pinned in (False, True):
        pcfg = TransferConfig(backend="nixl" if pinned else "auto", host_id="node-p",
                              **HB)  # type: ignore[arg-type]
        pmgr, dmgr, src_pool, dst_pool, seg = _pair(pcfg, TransferConfig(host_id="node-d", **HB))  # type: ignore[arg-type]
        try:
            engines = dmgr._decode.engines  # type: ignore[union-attr]
            started = threading.Event()
            engines.start("nixl", lambda err, ev=started: ev.set())
            assert started.wait(30) and engines.get("nixl") is not None
            engines._info["nixl"]["md"] = base64.b64encode(b"not nixl metadata").decode()
            s = pmgr.create_sender(1)
            r = dmgr.create_receiver(1, pmgr.bootstrap_addr)
            r.init([5, 6])
            if pinned:
                assert wait_for(r, KVPoll.Success, 10) == KVPoll.Failed
                reason = r.failure_reason or ""
                assert "nixl: connecting failed" in reason, reason
                assert "'node-p'" in reason and "'node-d'" in reason, reason
                s.abort("test done")
                continue
            assert wait_for(s, KVPoll.WaitingForInput, 10) == KVPoll.WaitingForInput
            s.send([1, 2], 0, True, AuxData(1, 0.0, 0))
            assert wait_for(r, KVPoll.Success) == KVPoll.Success, r.failure_reason
            assert torch.equal(dst_pool[[5, 6]].view(torch.int16),
                               src_pool[[1, 2]].view(torch.int16))
            chosen = [m for m in caplog.messages if m.startswith("kv transfer with decode")]
            assert chosen and "nixl: connecting failed" in chosen[-1], chosen
            assert chosen[-1].split(": ")[2].split(" ")[0] == CROSS_HOST[1], chosen
        finally:
            _close(pmgr, dmgr, seg)
