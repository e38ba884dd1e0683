"""The ucx backend's one-sided path: a chunk's pages written straight from the sender's pool
into the receiver's, with no staging on either side.

The receiver maps its pool for remote writes (ucp_rma.py) and announces the packed remote key
with the pool's base address, page size and page count (`rma` in its start_receiver info).
A sender whose peer announced one unpacks the key on its endpoint when it makes it, writes
each run of pages consecutive on both sides (descriptors.coalesce) with one put, flushes the
endpoint (remote completion: every byte has landed) and then sends the chunk's header as a
PUT item of a frame on the endpoint's default tag; the receiver checks it against the room
and counts it (ucx_recv.py). As with shm and nixl the receiver cannot refuse bytes: the pages
come from the room's registration (sender.py), the runs are checked against the peer's pool
and ours before a put, and the key covers the pool only.

`PDSERVE_UCX_RMA=0` on the receiver announces no key, and its senders use the two-sided path
(tagged messages through staging buffers, ucx.py), for comparison; so does a receiver where
libucp has no RMA symbols, with the reason logged once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import torch

from pdserve.kvtransfer.backends import ucp_rma
from pdserve.kvtransfer.backends.ucx_frames import PUT, pack
from pdserve.kvtransfer.descriptors import check_runs, coalesce
from pdserve.kvtransfer.engine import ChunkHeader
from pdserve.kvtransfer.trace import stamp

log = logging.getLogger("pdserve.kvtransfer")


def receiver_offers() -> bool:
    """Whether a receiver here maps its pool for one-sided writes."""
    if os.environ.get("PDSERVE_UCX_RMA", "1") == "0":
        return False
    why = ucp_rma.available()
    if why is not None:
        log.info("ucx: two-sided transfers only (%s)", why)
    return why is None


class PutSender:
    """A sender's remote keys, one per peer endpoint (loop thread only)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout = timeout_s
        self._keys: dict[str, ucp_rma.RemoteKey] = {}
        self._refused: set[str] = set()  # peers whose key or first put failed: staged

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

    def refuse(self, peer: str, why: Exception) -> None:
        """Staged messages to this peer from now on (UCX found no way to put there)."""
        log.warning("ucx: puts to %s failed (%s): staged messages instead", peer, why)
        self.forget(peer)
        self._refused.add(peer)

    def attach(self, peer: str, ep: Any, peer_info: dict[str, Any]) -> None:
        """The peer's key unpacked on its (new) endpoint."""
        self.forget(peer)
        if peer_info.get("rma") and peer not in self._refused:
            try:
                self._keys[peer] = ucp_rma.RemoteKey(ep, peer_info["rma"]["rkey"])
            except RuntimeError as e:
                self.refuse(peer, e)

    def forget(self, peer: str) -> None:
        """Before the peer's endpoint closes."""
        key = self._keys.pop(peer, None)
        if key is not None:
            key.close()

    def close(self) -> None:
        for peer in list(self._keys):
            self.forget(peer)

    async def warm(self, peer: str, pool: torch.Tensor, peer_info: dict[str, Any]) -> None:
        """One put of our page 0 into the peer's (the page no request uses), so that UCX's
        registrations and, on GPUs, the IPC mapping of the peer's pool are made now; where it
        fails, the peer is refused (staged messages)."""
        if peer not in self._keys:
            return
        page = pool[0].numel() * pool.element_size()
        try:
            await self._put_runs(peer, [(pool.data_ptr(), page, int(peer_info["rma"]["base"]))])
        except RuntimeError as e:
            self.refuse(peer, e)

    async def write(self, peer: str, ep: Any, pool: torch.Tensor, peer_info: dict[str, Any],
                    header: ChunkHeader) -> None:
        """The header's pages put and flushed, then the header sent as a PUT item."""
        runs = coalesce(header.descs)
        if len(runs):
            rma = peer_info["rma"]
            check_runs(runs, int(rma["num_pages"]), int(pool.shape[0]), peer)
            page, base, far = (pool[0].numel() * pool.element_size(), pool.data_ptr(),
                               int(rma["base"]))
            await self._put_runs(peer, [(base + int(s) * page, int(n) * page, far + int(d) * page)
                                        for s, d, n in runs.tolist()])
            stamp("staged", header.room)
        for msg in pack([PUT + header.to_bytes()]):
            await ep.send(msg)

    async def _put_runs(self, peer: str, runs: list[tuple[int, int, int]]) -> None:
        key = self._keys.get(peer)
        if key is None:
            raise RuntimeError(f"ucx: no remote key for peer {peer}")
        for local, nbytes, remote in runs:
            key.put(local, nbytes, remote)
        req = key.flush()
        deadline = time.monotonic() + self._timeout
        try:
            while not req.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ucx: puts to {peer} not flushed after {self._timeout}s")
                await asyncio.sleep(0)  # ucxx's progress thread moves the puts
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
