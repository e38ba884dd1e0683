"""The ucx backend between two real processes. Its staged path (the receiver offering no puts,
`PDSERVE_UCX_RMA=0`): a chunk cut into several messages (scattered pages gathered into
alternating staging buffers, runs sent straight from the pool) arrives bit-exact, also into
receive buffers smaller than the sender's messages would be; the connection to decode exists
once the handshake is done, before any page is sent; and an idle receiver does not spin. Its
one-sided path (the default): scattered pages and runs put straight into decode's pool arrive
bit-exact, nothing else of the pool is written, and the remote key is made at handshake; a
peer that UCX cannot put to gets staged messages."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.kv_peer import PeerProcess, PoolSpec, make_pool, page_checksum, wait_for
from pdserve.kvtransfer import AuxData, KVManager, KVPoll, TransferConfig
from pdserve.kvtransfer.backends import importable, ucp_rma

pytestmark = pytest.mark.skipif(not importable("ucx"), reason="ucxx is not installed")

SPEC = PoolSpec(num_pages=64, num_layers=3, page_size=4, num_kv_heads=2, head_dim=8)


def _put_fails(*_: object) -> None:
    raise RuntimeError("ucx: ucp_put_nbx failed (UCS status -3)")


@pytest.mark.parametrize("mode,prefill_pages,decode_pages", [
    ("staged", 3, 3), ("staged", 5, 2), ("puts", 3, 3), ("put refused", 3, 3)])
def test_pages_arrive_bit_exact_on_a_connection_made_at_handshake(
        mode: str, prefill_pages: int, decode_pages: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Staged (the decode process offers no puts): a few pages per message, so each chunk below
    # crosses several messages and both buffers; where decode's receive buffers are smaller
    # than prefill's messages would be, prefill cuts its messages (and its warm-up) to what
    # decode announced. One-sided: a put per run of pages, straight into decode's pool. Where
    # UCX refuses the handshake's put (no transport can reach the peer's memory), staged.
    monkeypatch.setenv("PDSERVE_UCX_RMA", "0" if mode == "staged" else "1")
    if mode == "put refused":
        monkeypatch.setattr(ucp_rma.RemoteKey, "put", _put_fails)  # in this (prefill) process
    puts = mode == "puts"
    cfg = TransferConfig(backend="ucx", stage_bytes=prefill_pages * SPEC.page_bytes,
                         heartbeat_interval_s=0.2, heartbeat_misses=5)
    decode = PeerProcess("decode", SPEC, TransferConfig(
        **{**cfg.__dict__, "stage_bytes": decode_pages * SPEC.page_bytes}))
    spec = PoolSpec(**{**SPEC.__dict__, "seed": 8})
    pool, _ = make_pool(spec)
    pmgr = KVManager("prefill", pool, cfg, spec.fingerprint())
    try:
        src = [*range(40, 48), 3, 9, 15, 21, 27, 33, 2, 50, 51, 52, 60]  # a run, then scattered
        dst = [*range(1, 9), 63, 57, 51, 45, 39, 33, 27, 20, 21, 22, 11]
        s = pmgr.create_sender(3)
        decode.call("create_receiver", 3, pmgr.bootstrap_addr)
        decode.call("init", 3, dst)
        assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput, s.failure_reason
        eng = pmgr._prefill.xfer.engine("ucx")  # type: ignore[union-attr]
        assert eng is not None and list(eng._eps) == [s.peer.hex()]  # type: ignore[union-attr]
        # one-sided: the remote key is unpacked on that endpoint, before any page is sent
        assert ("rma" in s.peer_info) == (mode != "staged")
        assert list(eng._puts._keys) == ([s.peer.hex()] if puts else [])  # type: ignore
        # host pools: nothing for UCX to map onto a GPU, so puts go a run at a time
        assert pmgr.transfer_paths() == {s.peer.hex(): "ucx/puts" if puts else "ucx/staged"}
        s.send(src[:8], 0, False)  # one run
        s.send(src[8:13], 8, False)  # scattered
        s.send(torch.tensor(src[13:]), 13, True, AuxData(5, -0.125, 2))
        assert wait_for(s, KVPoll.Success) == KVPoll.Success, s.failure_reason
        st, reason = decode.call("wait", 3, int(KVPoll.Success), 10)
        assert st == KVPoll.Success, reason
        assert decode.call("checksum", dst) == page_checksum(pool, src)
        assert decode.call("aux", 3) == (5, -0.125, 2)
        untouched = sorted(set(range(1, 64)) - set(dst))  # page 0 takes the warm-up put
        zeros, _ = make_pool(SPEC)
        assert decode.call("checksum", untouched) == page_checksum(zeros, untouched)
        # Idle, the receiver's loop still awaits the next header: it sleeps on it instead of
        # polling ucxx (which spun a core and held the GIL from the decode worker's threads).
        assert decode.call("cpu", 1.0) < 0.3
    finally:
        pmgr.close()
        assert decode.close() == []
    assert pmgr.registered_regions() == []


def test_a_chunk_whose_headers_exceed_one_frame_arrives_bit_exact() -> None:
    # 5,000 scattered one-page descriptors: 80 KB of header, more than one control frame.
    spec = PoolSpec(num_pages=10_240, num_layers=1, page_size=1, num_kv_heads=1, head_dim=8)
    cfg = TransferConfig(backend="ucx", heartbeat_interval_s=0.2, heartbeat_misses=5)
    decode = PeerProcess("decode", spec, cfg)
    pool, _ = make_pool(PoolSpec(**{**spec.__dict__, "seed": 3}))
    pmgr = KVManager("prefill", pool, cfg, spec.fingerprint())
    try:
        src = list(range(2, 10_002, 2))
        dst = list(range(10_001, 1, -2))
        s = pmgr.create_sender(4)
        decode.call("create_receiver", 4, pmgr.bootstrap_addr)
        decode.call("init", 4, dst)
        assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput, s.failure_reason
        s.send(src, 0, True, AuxData(7, -0.5, 0))
        assert wait_for(s, KVPoll.Success) == KVPoll.Success, s.failure_reason
        st, reason = decode.call("wait", 4, int(KVPoll.Success), 10)
        assert st == KVPoll.Success, reason
        assert decode.call("checksum", dst) == page_checksum(pool, src)
    finally:
        pmgr.close()
        assert decode.close() == []

