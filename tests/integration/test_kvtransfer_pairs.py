"""KV transfer between two real processes, for every backend: bit-exact pages, chunked sends,
aborts from each side, killed peers, rejected indices, fingerprint refusal, clean release."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pdserve.bench.kv_peer import PeerProcess, PoolSpec, make_pool, wait_for
from pdserve.kvtransfer import AuxData, KVManager, KVPoll, TransferConfig
from pdserve.kvtransfer.backends import importable

BACKENDS = ["tcp", "shm", "ucx", "nixl"]
HB = {"heartbeat_interval_s": 0.2, "heartbeat_misses": 3}  # 0.6 s window


def _cfg(backend: str, **kw: float) -> TransferConfig:
    return TransferConfig(backend=backend, **{**HB, **kw})  # type: ignore[arg-type]


def _spec(seed: int | None, shm: bool = False, **kw: int) -> PoolSpec:
    base = {"num_pages": 48, "num_layers": 3, "page_size": 4, "num_kv_heads": 2, "head_dim": 8}
    return PoolSpec(**{**base, **kw}, seed=seed, shm=shm)  # type: ignore[arg-type]


def _skip_missing(backend: str) -> None:
    if backend in ("ucx", "nixl") and not importable(backend):
        pytest.skip(f"{backend} is not installed")


@pytest.fixture
def decode_local(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """A decode KVManager in this process (pool zeroed; in shm for the shm backend)."""
    made: list[tuple[KVManager, object]] = []

    def make(backend: str, **kw: object) -> tuple[KVManager, torch.Tensor]:
        spec = _spec(None, shm=backend == "shm", **kw.pop("spec", {}))  # type: ignore[arg-type]
        pool, shm = make_pool(spec)
        mgr = KVManager("decode", shm or pool, _cfg(backend, **kw), spec.fingerprint())
        made.append((mgr, shm))
        return mgr, pool

    yield make
    for mgr, shm in made:
        mgr.close()
        assert mgr.registered_regions() == []
        if shm is not None:
            shm.close()  # type: ignore[attr-defined]
            assert not os.path.exists(f"/dev/shm/{shm.name}")  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_pages_arrive_bit_exact(backend: str, decode_local) -> None:  # type: ignore
    _skip_missing(backend)
    prefill = PeerProcess("prefill", _spec(seed=1), _cfg(backend))
    try:
        dmgr, dpool = decode_local(backend)
        src_pool, _ = make_pool(_spec(seed=1))
        room = (1 << 62) + 12345
        src = [5, 6, 7, 30, 2, 3, 40, 41, 42, 11]  # runs and singles
        dst = [20, 21, 22, 23, 9, 10, 44, 45, 1, 2]
        prefill.call("create_sender", room)
        r = dmgr.create_receiver(room, prefill.bootstrap_addr)
        r.init(dst)
        assert prefill.call("wait", room, int(KVPoll.WaitingForInput), 10)[0] == 2
        prefill.call("send", room, src[:4], 0, False, None)
        prefill.call("send", room, src[4:7], 4, False, None)
        assert wait_for(r, KVPoll.Transferring) == KVPoll.Transferring
        prefill.call("send", room, src[7:], 7, True, (1234, -0.25, 8))
        assert wait_for(r, KVPoll.Success) == KVPoll.Success, r.failure_reason
        assert prefill.call("wait", room, int(KVPoll.Success), 10)[0] == KVPoll.Success
        assert torch.equal(dpool[dst].view(torch.int16), src_pool[src].view(torch.int16))
        untouched = sorted(set(range(1, 48)) - set(dst))
        assert not dpool[untouched].view(torch.int16).any()
        assert r.aux == AuxData(1234, -0.25, 8)
    finally:
        assert prefill.close() == []


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_decode_registers_before_the_request_reaches_prefill(backend: str,
                                                             decode_local) -> None:  # type: ignore
    """A registration that comes first waits at prefill until the sender exists, then the
    room runs as usual."""
    prefill = PeerProcess("prefill", _spec(seed=3), _cfg(backend))
    try:
        dmgr, dpool = decode_local(backend)
        src_pool, _ = make_pool(_spec(seed=3))
        room = (1 << 62) + 777
        r = dmgr.create_receiver(room, prefill.bootstrap_addr)
        r.init([4, 5, 6])
        time.sleep(0.5)  # the REGISTER is at prefill, which has no sender for the room yet
        prefill.call("create_sender", room)
        assert prefill.call("wait", room, int(KVPoll.WaitingForInput), 10)[0] == 2
        prefill.call("send", room, [9, 10, 11], 0, True, (7, 0.0, 0))
        assert wait_for(r, KVPoll.Success) == KVPoll.Success, r.failure_reason
        assert torch.equal(dpool[[4, 5, 6]].view(torch.int16),
                           src_pool[[9, 10, 11]].view(torch.int16))
    finally:
        assert prefill.close() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_from_each_side(backend: str, decode_local) -> None:  # type: ignore
    _skip_missing(backend)
    prefill = PeerProcess("prefill", _spec(seed=2), _cfg(backend))
    try:
        dmgr, _ = decode_local(backend)
        r1 = dmgr.create_receiver(1, prefill.bootstrap_addr)
        r2 = dmgr.create_receiver(2, prefill.bootstrap_addr)
        for room, r in ((1, r1), (2, r2)):
            prefill.call("create_sender", room)
            r.init([3, 4])
            assert prefill.call("wait", room, int(KVPoll.WaitingForInput), 10)[0] == 2
        r1.abort("client went away")  # decode side
        st, reason = prefill.call("wait", 1, int(KVPoll.Success), 5)
        assert st == KVPoll.Failed and "client went away" in reason
        assert wait_for(r1, KVPoll.Success) == KVPoll.Failed
        prefill.call("abort", 2, "prefill oom")  # prefill side
        assert wait_for(r2, KVPoll.Success) == KVPoll.Failed
        assert "prefill oom" in (r2.failure_reason or "")
        prefill.call("send", 2, [5, 6], 0, True, (1, 0.0, 0))  # after abort: a no-op
        assert r2.poll() == KVPoll.Failed
    finally:
        assert prefill.close() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_prefill_fails_its_rooms_within_heartbeat(backend: str, decode_local) -> None:  # type: ignore
    _skip_missing(backend)
    prefill = PeerProcess("prefill", _spec(seed=3), _cfg(backend))
    dmgr, _ = decode_local(backend)
    rs = [dmgr.create_receiver(room, prefill.bootstrap_addr) for room in (7, 8, 9)]
    for room, r in zip((7, 8, 9), rs, strict=True):
        prefill.call("create_sender", room)
        r.init([room])
    assert wait_for(rs[0], KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    prefill.kill()
    t0 = time.monotonic()
    assert all(wait_for(r, KVPoll.Success, 5) == KVPoll.Failed for r in rs)
    assert time.monotonic() - t0 < 0.6 + 0.5  # heartbeat window + a tick
    assert "silent" in (rs[0].failure_reason or "")


def test_killed_decode_fails_prefill_rooms() -> None:
    decode = PeerProcess("decode", _spec(None), _cfg("tcp"))
    spec = _spec(seed=4)
    pool, _ = make_pool(spec)
    pmgr = KVManager("prefill", pool, _cfg("tcp"), spec.fingerprint())
    try:
        s = pmgr.create_sender(5)
        decode.call("create_receiver", 5, pmgr.bootstrap_addr)
        decode.call("init", 5, [1, 2, 3])
        assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        assert s.num_dst_pages == 3
        decode.kill()
        t0 = time.monotonic()
        assert wait_for(s, KVPoll.Success, 5) == KVPoll.Failed
        assert time.monotonic() - t0 < 0.6 + 0.5
    finally:
        pmgr.close()
    assert pmgr.registered_regions() == []
