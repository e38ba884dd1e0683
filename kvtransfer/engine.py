"""TransferEngine: the data plane that moves a chunk's page runs from a sender's pool into a
receiver's pool. Control (bootstrap, registration, acks, heartbeats) lives in the KVManager.

A sender calls `write()` from its single transfer thread; a receiver calls `start_receiver()`
once and is told about chunks through a ReceiveHandler, which validates every header before a
byte is placed (rejected data is never written). Backends that write one-sided (shm, cuda_ipc)
cannot be refused by the receiver: the sender validates against the registration instead and the
header follows (`one_sided = True`): straight from the transfer thread when the engine has a
same-host channel to the receiver (`notify()`), else over the control channel.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.lanes import Part
from pdserve.kvtransfer.trace import stamp

log = logging.getLogger("pdserve.kvtransfer")

__all__ = ["ChunkHeader", "ReceiveHandler", "TransferEngine", "count_landed"]


class ReceiveHandler(Protocol):
    def place_chunk(self, peer: str, header: ChunkHeader, nbytes: list[int] | None,
                    write: Callable[[list[torch.Tensor]], None]) -> bool:
        """Validate the header against the room's registration (and the payload sizes, when
        given); if valid, call `write(views)` with one destination view per descriptor, record
        the arrival and return True. Invalid or late chunks are dropped (write is never called).
        Validation, write and bookkeeping happen under the room's lock, so once a room is seen
        Failed nothing writes its pages any more."""


def count_landed(handler: ReceiveHandler | None, name: str, header: bytes) -> None:
    """Receiver of a one-sided engine whose notification comes once the bytes are in place:
    the header's checks and the count remain (a malformed header is dropped and logged)."""
    try:
        h = ChunkHeader.from_bytes(header)
    except ValueError as e:
        log.warning("%s: malformed chunk notification dropped: %s", name, e)
        return
    stamp("landed", h.room)
    if handler is not None:
        handler.place_chunk(name, h, None, lambda views: None)


class TransferEngine(ABC):
    """Owns registered memory regions and one transport."""

    name: str = "abstract"
    one_sided: bool = False
    # write_lanes takes parts that name a range of heads (it copies them itself); False: whole
    # pages only (heads are gathered into staging first).
    head_parts: bool = False

    def __init__(self) -> None:
        self._regions: dict[str, torch.Tensor] = {}

    # -- memory regions -------------------------------------------------------------------
    def register(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._regions:
            raise ValueError(f"name: region {name!r} already registered")
        self._regions[name] = tensor

    def deregister(self, name: str) -> None:
        self._regions.pop(name, None)

    def region(self, name: str) -> torch.Tensor:
        return self._regions[name]

    @property
    def registered(self) -> list[str]:
        return sorted(self._regions)

    def paths(self) -> dict[str, str]:
        """Sender: how pages move to each connected peer, where a backend has several ways."""
        return {}

    # -- receiving side -------------------------------------------------------------------
    @abstractmethod
    def start_receiver(self, handler: ReceiveHandler) -> dict[str, Any]:
        """Start accepting chunks; returns what a sender needs to reach us (JSON-able)."""

    # -- sending side (one transfer thread) -----------------------------------------------
    def connect(self, peer: str, peer_info: dict[str, Any]) -> Future | None:
        """Set up the connection to a peer at handshake, so that no request waits for it
        (backends.CONNECT_AT_BOOTSTRAP). None once connected (raises if the peer cannot be
        reached), or a Future that completes when it is, for connections that take a network
        round trip: the transfer thread does not wait for them, so other peers' chunks keep
        moving. write() connects on its own to a peer it does not know yet."""
        return None

    @abstractmethod
    def write(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> None:
        """Move the header's descriptors from the local "kv" region into the peer's pool.
        Blocks until the local pages may be reused; raises on failure."""

    def write_lanes(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader,
                    parts: list[Part]) -> None:
        """A chunk for a decode worker of several tensor-parallel ranks (or of a KV layout
        other than ours): every part's whole pages into the pool of its lane's decode rank
        (backends.LANE_BACKENDS). As write(): blocks until the parts' sources may be reused."""
        raise NotImplementedError(f"{self.name}: no tensor-parallel lanes")

    def completion(self) -> bytes:
        """One-sided engines whose write() returns before the bytes land: what the receiver
        needs to wait for them (sent with the chunk's notification). Empty: already complete."""
        return b""

    def notify(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> bool:
        """One-sided engines: tell the receiver that `header`'s pages were written, from the
        calling (transfer) thread. False when there is no direct channel to this peer: the
        manager then sends the header over the control channel. Raises on a broken channel."""
        return False

    def quiesce(self) -> None:
        """Block until no write is in flight (a room is being failed: its pages may be reused
        by their owners as soon as this returns). Any thread."""

    def deliver(self, header: bytes, token: bytes) -> None:
        """Receiver side of a one-sided engine: a chunk notification arrived (over the control
        channel or the engine's own); wait for its writes to land, then count it."""

    def wait_completion(self, token: bytes) -> None:
        """Receiver side: block until the writes a `completion()` token covers have landed."""

    def drop_peer(self, peer: str) -> None:
        """Forget a peer's connection (it died or restarted)."""

    def close(self) -> None:
        """Stop threads, close sockets and mappings, deregister every region."""
        self._regions.clear()
