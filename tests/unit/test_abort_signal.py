"""router/events.AbortSignal: callbacks at set, at once after it, never twice, unsubscribed."""

from __future__ import annotations

from pdserve.router.events import AbortSignal


def test_abort_signal_calls_each_subscriber_once() -> None:
    sig, seen = AbortSignal(), []
    sig.subscribe(lambda: seen.append("a"))
    drop = sig.subscribe(lambda: seen.append("b"))
    drop()
    assert not sig.is_set() and seen == []
    sig.set()
    sig.set()
    assert sig.is_set() and seen == ["a"]
    sig.subscribe(lambda: seen.append("late"))  # already set: called at once
    assert seen == ["a", "late"]
