"""KV between tensor-parallel workers of different sizes, two real processes: every decode rank
gets its heads of every page from the prefill ranks that hold them (split, gathered, replicated
heads), bit-exact, for the backends that map layouts; one that cannot (ucx) is refused at the
handshake naming both layouts, and so is a layout no prefill rank set covers."""

from __future__ import annotations

import pytest

from pdserve.bench.kv_peer import PeerProcess, PoolSpec, kv_checksum, make_manager, wait_for
from pdserve.kvtransfer import KVPoll, TransferConfig
from pdserve.kvtransfer.backends import importable

HB = {"heartbeat_interval_s": 0.2, "heartbeat_misses": 3}
SRC = [5, 6, 7, 30, 2, 3, 40, 41, 42, 11]  # runs and singles
DST = [20, 21, 22, 23, 9, 10, 44, 45, 1, 2]


def _spec(heads: int, tp: int, seed: int | None = None, shm: bool = False) -> PoolSpec:
    return PoolSpec(num_pages=48, num_layers=3, page_size=4, num_kv_heads=heads, head_dim=8,
                    seed=seed, shm=shm, tp=tp)


def _transfer(backend: str, heads: int, prefill_tp: int, decode_tps: list[int]
              ) -> list[tuple[KVPoll, str | None, bool]]:
    """One prefill process of `prefill_tp` ranks feeding a decode manager of each of
    `decode_tps` ranks in turn: (status, failure reason, whole KV equal) for each."""
    cfg = TransferConfig(backend=backend, **HB)  # type: ignore[arg-type]
    prefill = PeerProcess("prefill", _spec(heads, prefill_tp, seed=1), cfg)
    out = []
    try:
        for i, decode_tp in enumerate(decode_tps):
            mgr, pools, shms = make_manager("decode", _spec(heads, decode_tp,
                                                            shm=backend == "shm"), cfg)
            try:
                out.append(_room(prefill, mgr, pools, (1 << 61) + i))
            finally:
                mgr.close()
                assert mgr.registered_regions() == []
                for shm in shms:
                    shm.close()
    finally:
        assert prefill.close() == []
    return out


def _room(prefill: PeerProcess, mgr, pools, room: int  # type: ignore[no-untyped-def]
          ) -> tuple[KVPoll, str | None, bool]:
    prefill.call("create_sender", room)
    r = mgr.create_receiver(room, prefill.bootstrap_addr)
    r.init(DST)
    if wait_for(r, KVPoll.WaitingForInput) == KVPoll.Failed:  # refused at the handshake
        return KVPoll.Failed, r.failure_reason, False
    assert prefill.call("wait", room, int(KVPoll.WaitingForInput), 10)[0] == 2
    prefill.call("send", room, SRC[:4], 0, False, None)
    prefill.call("send", room, SRC[4:], 4, True, (3, -0.25, 0))
    status = wait_for(r, KVPoll.Success)
    return status, r.failure_reason, kv_checksum(pools, DST) == prefill.call("checksum", SRC)


@pytest.mark.parametrize(("backend", "heads", "prefill_tp", "decode_tps"), [
    ("shm", 4, 1, [2]), ("shm", 4, 2, [1, 4, 2]), ("shm", 3, 3, [1]), ("shm", 2, 4, [2]),
    ("tcp", 4, 1, [2]), ("tcp", 4, 2, [1, 4])])
def test_each_decode_rank_gets_its_heads(backend: str, heads: int, prefill_tp: int,
                                         decode_tps: list[int]) -> None:
    """1->2 (split), 2->1 (gathered), 2->4 (decode replicates), 2->2 (whole pages), 3->1
    (SmolLM2's 3 KV heads), 4->2 (prefill replicates: one replica read)."""
    for decode_tp, (status, reason, same) in zip(decode_tps, _transfer(
            backend, heads, prefill_tp, decode_tps)):
        assert status == KVPoll.Success, (decode_tp, reason)
        assert same, decode_tp


@pytest.mark.skipif(not importable("ucx"), reason="ucx is not installed")
def test_a_backend_that_cannot_map_layouts_is_refused_naming_both() -> None:
    [(status, reason, _)] = _transfer("ucx", 4, 2, [1])
    assert status == KVPoll.Failed
    assert "prefill tp=2 (kv heads 0-1 | 2-3 of 4), decode tp=1 (kv heads 0-3 of 4)" in reason
    assert "ucx" in reason


def test_a_layout_without_every_head_is_refused_naming_both() -> None:
    """A decode claiming heads the prefill layout does not cover (a build that split heads
    differently) is refused at the handshake, before any page moves."""
    from pdserve.kvtransfer.lanes import KVLayout, LayoutError, plan_lanes

    with pytest.raises(LayoutError, match=r"prefill tp=2 \(kv heads 0-1 \| 2-3 of 4\), decode "
                                          r"tp=1 \(kv heads 0-4 of 4\)"):
        plan_lanes(KVLayout(4, ((0, 2), (2, 2))), KVLayout(4, ((0, 5),)))
    with pytest.raises(LayoutError, match="no prefill rank holds KV heads \\[3\\]"):
        plan_lanes(KVLayout(4, ((0, 2), (1, 2))), KVLayout(4, ((0, 4),)))


def test_kvbench_reports_heterogeneous_against_homogeneous(capsys: pytest.CaptureFixture) -> None:
    """`pdserve kvbench --prefill-tp 2 --decode-tp 1` measures 2 -> 1 and 1 -> 1 in one run;
    a split the ranks cannot make is refused up front."""
    import json

    from pdserve.bench.kv import main

    assert main(["--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "4", "--backend", "shm",
                 "--tokens", "64", "--requests", "2", "--layout", "random", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tp"], r["checksum_ok"]) for r in rows] == [("2->1", True), ("1->1", True)]
    assert rows[0]["vs_homog"] > 0 and "vs_homog" not in rows[1]
    assert main(["--prefill-tp", "2", "--decode-tp", "1", "--backend", "shm"]) == 2
    assert "cannot split 3 KV heads" in capsys.readouterr().err
