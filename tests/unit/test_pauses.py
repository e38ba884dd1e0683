"""pdserve/pauses.py: the GIL switch interval a worker sets, and the heap frozen after start-up."""

from __future__ import annotations

import gc
import sys

import pytest

from pdserve.pauses import set_switch_interval, settle_heap


def test_switch_interval_is_set_in_ms_and_must_be_positive() -> None:
    before = sys.getswitchinterval()
    try:
        set_switch_interval(0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        for bad in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="switch_interval_ms"):
                set_switch_interval(bad)
    finally:
        sys.setswitchinterval(before)


def test_settle_heap_freezes_what_survives_a_collection() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector can free it

    kept = [Node() for _ in range(100)]
    Node()  # garbage: collected, not frozen
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(kept)
        assert not any(gc.is_tracked(x) and x in gc.get_objects(0) for x in kept[:3])
    finally:
        gc.unfreeze()


def test_worker_refuses_a_bad_switch_interval(capsys) -> None:  # noqa: ANN001
    from pdserve.decode.main import main_mixed

    assert main_mixed(["--device", "cpu", "--switch-interval-ms", "0"]) == 2
    assert "switch_interval_ms: must be > 0" in capsys.readouterr().err
