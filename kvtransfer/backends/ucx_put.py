"""The ucx backend's one-sided path: a chunk's pages written straight from the sender's pool
into the receiver's, with no staging on either side.

The receiver maps its pool for remote writes (ucp_rma.py) and announces the packed remote key
with the pool's base address, page size and page count (`rma` in its start_receiver info).
A sender whose peer announced one unpacks the key on its endpoint when it makes it (at
handshake, on the ucx loop). Its transfer thread then writes each run of pages consecutive on
both sides (descriptors.coalesce) with one put, flushes the endpoint (remote completion: every
byte has landed; the wait progresses the worker) and returns; the chunk's header follows over
the control channel (`notify()` False), and the receiver checks it against the room and counts
it (UcxEngine.deliver). No hand-over to the ucx loop on either side: on one H200 that hop and
a tagged header message cost about a millisecond of a 4096-token room's 4.4. As with shm and
nixl the receiver cannot refuse bytes: the pages come from the room's registration
(sender.py), the runs are checked against the peer's pool and ours before a put, and the key
covers the pool only.

`PDSERVE_UCX_RMA=0` on the receiver announces no key, and its senders use the two-sided path
(tagged messages through staging buffers, ucx.py), for comparison; so does a receiver where
libucp has no RMA symbols, with the reason logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import cache
from typing import Any

import torch

from pdserve.envs import envs
from pdserve.kvtransfer.backends import ucp_rma
from pdserve.kvtransfer.descriptors import check_runs, coalesce
from pdserve.kvtransfer.engine import ChunkHeader
from pdserve.kvtransfer.trace import stamp

log = logging.getLogger("pdserve.kvtransfer")


@cache
def receiver_offers() -> bool:
    """Whether a receiver here maps its pool for one-sided writes (the reason logged once)."""
    if not envs().ucx_rma:
        return False
    why = ucp_rma.available()
    if why is not None:
        log.info("ucx: two-sided transfers only (%s)", why)
    return why is None


class PutSender:
    """A sender's remote keys, one per peer endpoint. Made and dropped on the ucx loop (with
    the endpoints), used by the transfer thread; the lock keeps a key alive while it puts."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout = timeout_s
        self._keys: dict[str, ucp_rma.RemoteKey] = {}
        self._refused: set[str] = set()  # peers whose key or first put failed: staged
        self._lock = threading.Lock()

    def wanted(self, peer: str, pool: torch.Tensor, peer_info: dict[str, Any]) -> bool:
        """Whether chunks to this peer go one-sided: it announced a key for pages of our size
        and neither unpacking it nor the warm-up put failed."""
        rma = peer_info.get("rma")
        if not rma or peer in self._refused:
            return False
        page = pool[0].numel() * pool.element_size()
        if int(rma["page_bytes"]) != page:
            raise ValueError(f"page_bytes: the peer's pool has {rma['page_bytes']}, ours {page}")
        return True

    def has_key(self, peer: str) -> bool:
        return peer in self._keys

    def refuse(self, peer: str, why: Exception) -> None:
        """Staged messages to this peer from now on (UCX found no way to put there)."""
        log.warning("ucx: puts to %s failed (%s): staged messages instead", peer, why)
        self.forget(peer)
        self._refused.add(peer)

    def attach(self, peer: str, ep: Any, peer_info: dict[str, Any]) -> None:
        """The peer's key unpacked on its new endpoint (the old one's forgotten first)."""
        if peer_info.get("rma") and peer not in self._refused:
            try:
                key = ucp_rma.RemoteKey(ep, peer_info["rma"]["rkey"])
            except RuntimeError as e:
                self.refuse(peer, e)
                return
            with self._lock:
                self._keys[peer] = key

    def forget(self, peer: str) -> None:
        """Before the peer's endpoint closes."""
        with self._lock:
            key = self._keys.pop(peer, None)
            if key is not None:
                key.close()

    def close(self) -> None:
        for peer in list(self._keys):
            self.forget(peer)

    def warm(self, peer: str, pool: torch.Tensor, peer_info: dict[str, Any]) -> None:
        """One put of our page 0 into the peer's (the page no request uses), so that UCX's
        registrations and, on GPUs, the IPC mapping of the peer's pool are made now; where it
        fails, the peer is refused (staged messages)."""
        if peer not in self._keys:
            return
        page = pool[0].numel() * pool.element_size()
        try:
            self._put_runs(peer, [(pool.data_ptr(), page, int(peer_info["rma"]["base"]))])
        except RuntimeError as e:
            self.refuse(peer, e)

    def write(self, peer: str, pool: torch.Tensor, peer_info: dict[str, Any],
              header: ChunkHeader) -> None:
        """The header's pages put, and the endpoint flushed: back once they have landed."""
        runs = coalesce(header.descs)
        if not len(runs):
            return
        rma = peer_info["rma"]
        check_runs(runs, int(rma["num_pages"]), int(pool.shape[0]), peer)
        page, base, far = pool[0].numel() * pool.element_size(), pool.data_ptr(), int(rma["base"])
        self._put_runs(peer, [(base + int(s) * page, int(n) * page, far + int(d) * page)
                              for s, d, n in runs.tolist()], header.room)
        stamp("staged", header.room)

    def _put_runs(self, peer: str, runs: list[tuple[int, int, int]], room: int = -1) -> None:
        with self._lock:
            key = self._keys.get(peer)
            if key is None or key.closed:
                raise RuntimeError(f"ucx: no remote key for peer {peer} (its endpoint closed)")
            key.put(runs)
            if room >= 0:  # not the warm-up: the puts' issue, apart from their landing
                stamp("issued", room)
            req = key.flush()
            deadline = time.monotonic() + self._timeout
            try:
                while not req.done():  # each check progresses the worker (GIL released)
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"ucx: puts to {peer} not flushed after {self._timeout}s")
            finally:
                req.release()


def offer(pool: torch.Tensor) -> tuple[ucp_rma.PoolMapping | None, dict[str, Any]]:
    """The receiver's mapping of its pool and the start_receiver info for it (none when it
    offers no one-sided writes, or the mapping fails: then the reason is logged)."""
    if not receiver_offers():
        return None, {}
    try:
        mapping = ucp_rma.PoolMapping(pool)
    except RuntimeError as e:
        log.warning("ucx: two-sided transfers only: %s", e)
        return None, {}
    return mapping, {"rma": mapping.info}
