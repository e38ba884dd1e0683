"""The router's queue gate: each worker's queue past its running ceiling, the default bound
sized from the decode side's slots, 429 past it, Retry-After from the completion rate."""

from __future__ import annotations

import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.admission import QUEUE_PER_SLOT, RETRY_AFTER_UNKNOWN_S, QueueGate
from pdserve.router.config import RouterConfig
from pdserve.router.errors import Overloaded
from pdserve.router.registry import Registry


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _registry(**slots: int) -> Registry:
    """Static workers `role_i` with max_running from `slots` (decode_0=8, prefill_0=8, ...)."""
    by_role: dict[str, list[str]] = {"prefill": [], "decode": [], "mixed": []}
    for i, name in enumerate(slots):
        by_role[name.rsplit("_", 1)[0]].append(f"127.0.0.1:{5000 + i}")
    reg = Registry(RouterConfig(prefill_addrs=tuple(by_role["prefill"]),
                                decode_addrs=tuple(by_role["decode"]),
                                mixed_addrs=tuple(by_role["mixed"])))
    for w, n in zip(reg.all(), [slots[k] for k in sorted(slots)], strict=True):
        w.state = "healthy"
        w.load = pb.WorkerLoad(max_running=n)
    return reg


def _worker(reg: Registry, role: str) -> object:
    return next(w for w in reg.all() if w.role == role)


def test_queue_of_a_worker_is_past_its_ceiling() -> None:
    reg = _registry(decode_0=4, prefill_0=4)
    d = _worker(reg, "decode")
    d.inflight = 3
    assert d.queued == 0
    d.inflight = 7
    assert d.queued == 3
    d.load = pb.WorkerLoad(max_running=4, num_running=4, num_waiting=6)  # other routers' too
    assert d.queued == 6
    d.load = pb.WorkerLoad()  # a worker that reports no ceiling has no known queue
    assert d.queued == 0
    # Prefill workers are not counted: every request passes one decode (or mixed) worker.
    _worker(reg, "prefill").inflight = 50
    d.load = pb.WorkerLoad(max_running=4)
    assert reg.queued_requests() == 3


def test_default_bound_and_refusal() -> None:
    reg = _registry(decode_0=4, mixed_0=2, prefill_0=8)
    gate = QueueGate(None, reg)
    assert gate.limit() == QUEUE_PER_SLOT * 6
    d = _worker(reg, "decode")
    d.inflight = 4 + QUEUE_PER_SLOT * 6 - 1
    gate.admit()
    d.inflight += 1
    with pytest.raises(Overloaded) as e:
        gate.admit()
    assert e.value.status == 429 and e.value.headers()["Retry-After"] == str(
        RETRY_AFTER_UNKNOWN_S)
    d.state = "unhealthy"  # out of rotation: its slots no longer count toward the bound
    assert gate.limit() == QUEUE_PER_SLOT * 2
    assert QueueGate(None, _registry(decode_0=0)).limit() is None  # no ceiling known: no gate
    zero = QueueGate(0, reg)
    d.inflight = 4
    with pytest.raises(Overloaded):
        zero.admit()  # bound 0: nothing may wait


def test_retry_after_follows_the_completion_rate() -> None:
    clock = Clock()
    gate = QueueGate(10, _registry(decode_0=4), clock)
    for _ in range(20):  # 2 requests/s over the 10 s window
        gate.finished()
    assert gate.retry_after_s(10) == 5
    assert gate.retry_after_s(1) == 1
    assert gate.retry_after_s(100_000) == 60  # capped
    clock.t += 11  # the window slid past them
    assert gate.retry_after_s(10) == RETRY_AFTER_UNKNOWN_S


def test_config_rejects_a_negative_bound() -> None:
    with pytest.raises(ValueError, match="max_queued_requests"):
        RouterConfig(max_queued_requests=-1)
