"""The ucx backend's control frames: items round-trip through a fixed-size receive buffer,
oversized bodies go announced, malformed frames are refused."""

from __future__ import annotations

import random

import pytest

from pdserve.kvtransfer.backends import ucx_frames as f


def _receive(messages: list[bytes]) -> list[bytes]:
    """What the receiver makes of `messages`, each landed in a FRAME_BYTES buffer (stale
    bytes from an earlier frame left behind it) as UCX would."""
    frame = bytearray(b"\xee" * f.FRAME_BYTES)
    msgs = iter(messages)
    out = []
    for m in msgs:
        frame[:len(m)] = m
        body = f.body_of(frame)
        n = f.announced(body)
        if n is not None:
            body = next(msgs)
            assert len(body) == n
        out += f.items(body)
    return out


@pytest.mark.parametrize("sizes", [[], [0], [1, 7, 300], [f.FRAME_BYTES // 3] * 2,
                                   [f.FRAME_BYTES], [5, f.FRAME_BYTES * 3, 9]])
def test_items_round_trip(sizes: list[int]) -> None:
    rng = random.Random(len(sizes) * 31 + sum(sizes))
    items = [rng.randbytes(n) for n in sizes]
    messages = f.pack(items)
    fits = 8 + sum(4 + n for n in sizes) <= f.FRAME_BYTES
    assert len(messages) == (1 if fits else 2)
    assert all(len(m) <= f.FRAME_BYTES for m in messages[:1])
    assert _receive(messages) == items


def test_frames_in_sequence_do_not_leak_into_each_other() -> None:
    first, second = f.pack([b"a" * 1000, b"b" * 50]), f.pack([b"c"])
    assert _receive(first + second) == [b"a" * 1000, b"b" * 50, b"c"]


def test_malformed_frames_are_refused() -> None:
    frame = bytearray(64)
    frame[:8] = (100).to_bytes(8, "little")
    with pytest.raises(ValueError, match="exceeds"):
        f.body_of(frame)
    with pytest.raises(ValueError, match="past its end"):
        f.items((10).to_bytes(4, "little") + b"abc")
    with pytest.raises(ValueError, match="truncated"):
        f.items(b"\x01\x00")
    with pytest.raises(ValueError, match="exceeds"):
        f.announced(f.BIG + (f.MAX_BODY_BYTES + 1).to_bytes(8, "little"))
    assert f.announced(b"x" * 16) is None
