"""The same-host notification socket (kvtransfer/backends/same_host.py): messages arrive whole
and in order whatever their size, a malformed stream is cut off without hurting other
senders, an unreachable socket means "no channel", and close() leaves nothing behind."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from pdserve.kvtransfer.backends.same_host import NotifyListener, NotifySender


class _Inbox:
    def __init__(self) -> None:
        self.got: list[tuple[bytes, bytes]] = []
        self.cv = threading.Condition()

    def __call__(self, header: bytes, token: bytes) -> None:
        with self.cv:
            self.got.append((header, token))
            self.cv.notify_all()

    def wait(self, n: int, timeout: float = 5.0) -> list[tuple[bytes, bytes]]:
        with self.cv:
            self.cv.wait_for(lambda: len(self.got) >= n, timeout)
            return list(self.got)


def test_messages_arrive_whole_and_in_order() -> None:
    inbox = _Inbox()
    listener = NotifyListener(inbox)
    sender = NotifySender(timeout_s=5)
    try:
        big = os.urandom(3 << 20)  # larger than one recv(): reassembled
        msgs = [(b"h1", b""), (big, b"tok"), (b"h3", b"\x00" * 64)]
        for header, token in msgs:
            assert sender.send("peer", listener.path, header, token)
        assert inbox.wait(3) == msgs
    finally:
        sender.close()
        listener.close()
    assert not os.path.exists(listener.path)


def test_malformed_stream_is_cut_off_and_others_still_heard() -> None:
    inbox = _Inbox()
    listener = NotifyListener(inbox)
    sender = NotifySender(timeout_s=5)
    try:
        rogue = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        rogue.connect(listener.path)
        rogue.sendall(struct.pack("<II", 4, 9) + b"abcd")  # token longer than the message
        assert rogue.recv(1) == b""  # the listener closed it
        rogue.close()
        assert sender.send("peer", listener.path, b"ok", b"")
        assert inbox.wait(1) == [(b"ok", b"")]
    finally:
        sender.close()
        listener.close()


def test_unreachable_socket_means_no_channel() -> None:
    sender = NotifySender(timeout_s=1)
    assert not sender.send("peer", "/nonexistent/pdkv_x.sock", b"h", b"")
    assert not sender.send("peer", "/nonexistent/pdkv_x.sock", b"h", b"")  # remembered
    sender.close()


def test_send_to_a_closed_listener_raises() -> None:
    listener = NotifyListener(_Inbox())
    sender = NotifySender(timeout_s=1)
    assert sender.send("peer", listener.path, b"h", b"")
    listener.close()
    time.sleep(0.05)
    with pytest.raises(OSError):
        for _ in range(100):  # the first sends may still land in the socket buffer
            sender.send("peer", listener.path, b"h" * 4096, b"")
    sender.close()
