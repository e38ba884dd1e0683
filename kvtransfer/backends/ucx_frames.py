"""The ucx backend's control messages: a chunk's piece headers (or a connection's warm-up
notes) travel together as one frame, received into one fixed-size buffer.

Each message the receiver must see before it can post a payload's receive costs a round of
the loop on both sides (and, idle, a hand-over from ucxx's notifier thread), so a chunk's
headers go as one message rather than two per piece (`send_obj`'s size, then its bytes). A
frame is `u64 body length` then the body, a sequence of `u32 length` + item; the receiver
posts a FRAME_BYTES receive (UCX takes a message shorter than the buffer). Items that do not
fit (a chunk of thousands of scattered descriptors) go as an announcement frame (`BIG` and
the body's length) followed by the body as a message of its own.
"""

from __future__ import annotations

import struct

FRAME_BYTES = 64 << 10
MAX_BODY_BYTES = 256 << 20  # an announced body larger than this is refused
BIG = b"PDKVBIG!"
_LEN = struct.Struct("<Q")
_ITEM = struct.Struct("<I")


def pack(items: list[bytes]) -> list[bytes]:
    """The messages that carry `items` in order: one frame when they fit, else an
    announcement frame and the body."""
    body = b"".join(_ITEM.pack(len(i)) + i for i in items)
    if _LEN.size + len(body) <= FRAME_BYTES:
        return [_LEN.pack(len(body)) + body]
    note = BIG + _LEN.pack(len(body))
    return [_LEN.pack(len(note)) + note, body]


def body_of(frame: bytearray | memoryview) -> bytes:
    """A received frame's body (copied: the buffer takes the next frame)."""
    (n,) = _LEN.unpack_from(frame)
    if n > len(frame) - _LEN.size:
        raise ValueError(f"frame body of {n} bytes exceeds the {len(frame)}-byte frame")
    return bytes(frame[_LEN.size:_LEN.size + n])


def announced(body: bytes) -> int | None:
    """The length of the body that follows as its own message, when `body` announces one."""
    if len(body) != len(BIG) + _LEN.size or not body.startswith(BIG):
        return None
    (n,) = _LEN.unpack_from(body, len(BIG))
    if n > MAX_BODY_BYTES:
        raise ValueError(f"announced frame body of {n} bytes exceeds {MAX_BODY_BYTES}")
    return n


def items(body: bytes) -> list[bytes]:
    """The items of a frame body, in order."""
    out, at = [], 0
    while at < len(body):
        if at + _ITEM.size > len(body):
            raise ValueError("frame body: truncated item length")
        (n,) = _ITEM.unpack_from(body, at)
        at += _ITEM.size
        if at + n > len(body):
            raise ValueError(f"frame body: item of {n} bytes past its end")
        out.append(body[at:at + n])
        at += n
    return out
