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

Where UCX can map the receiver's GPU pool onto the sender's own GPU (`ucp_rkey_ptr`: its
cuda_ipc transport opens the pool's IPC handle here, for two processes on one GPU), a put per
run would cost a driver copy and an event each (~11 us of host time per page on an H100, which
bounds a scattered 4096-token room near 130 GB/s); the sender copies the chunk's pages with
one kernel through that mapping instead (kernels/page_p2p_copy.py, as the cuda_ipc backend
does), and waits for it before the header goes. Peers that UCX reaches only by puts (other
hosts; a pool on another GPU, whose mapping our kernels cannot use) keep one put per run;
`PDSERVE_UCX_MAPPED=0` keeps puts everywhere.

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

import numpy as np
import torch

from pdserve.envs import envs
from pdserve.kvtransfer.backends import ucp_rma
from pdserve.kvtransfer.descriptors import DST, SRC, check_runs, coalesce, run_pages
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
        self._mapped: dict[str, _MappedPool] = {}  # peers whose pool UCX maps onto our GPU
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

    def path(self, peer: str) -> str:
        """How chunks to this peer move: "mapped" (one kernel), "puts" or "staged"."""
        if peer in self._mapped:
            return "mapped"
        return "puts" if peer in self._keys else "staged"

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
            self._mapped.pop(peer, None)
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
        if self._map(peer, pool, peer_info["rma"]):
            return
        page = pool[0].numel() * pool.element_size()
        try:
            self._put_runs(peer, [(pool.data_ptr(), page, int(peer_info["rma"]["base"]))])
        except RuntimeError as e:
            self.refuse(peer, e)

    def _map(self, peer: str, pool: torch.Tensor, rma: dict[str, Any]) -> bool:
        """The peer's pool mapped onto our GPU, and its copy kernel built and run once (page
        0 into page 0, which no request uses; Triton compiles it now, not on a room's path);
        False where UCX cannot map it here or the kernel fails (then puts)."""
        if not (envs().ucx_mapped and pool.is_cuda):
            return False
        with torch.cuda.device(pool.device):
            # UCX opens the handle in this thread's current context: a runtime call binds
            # the device's primary context to this (loop) thread first.
            torch.cuda.current_stream(pool.device).query()
            ptr = self._keys[peer].pointer(int(rma["base"]))
            if ptr is None:
                log.info("ucx: UCX cannot map the pool of %s here: one put per run", peer)
                return False
            try:
                mapped = _MappedPool(ptr, int(rma["num_pages"]), pool)
                mapped.copy(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
            except (ImportError, RuntimeError, ValueError) as e:
                log.warning("ucx: no kernel copy into the pool of %s (%s): puts", peer, e)
                return False
        with self._lock:
            self._mapped[peer] = mapped
        log.info("ucx: the pool of %s is mapped onto this GPU: one copy kernel per chunk", peer)
        return True

    def write(self, peer: str, pool: torch.Tensor, peer_info: dict[str, Any],
              header: ChunkHeader) -> None:
        """The header's pages put, and the endpoint flushed: back once they have landed."""
        runs = coalesce(header.descs)
        if not len(runs):
            return
        rma = peer_info["rma"]
        check_runs(runs, int(rma["num_pages"]), int(pool.shape[0]), peer)
        with self._lock:
            mapped = self._mapped.get(peer)
            if mapped is not None:
                mapped.copy(run_pages(header.descs, SRC), run_pages(header.descs, DST),
                            header.room)
        if mapped is not None:
            stamp("staged", header.room)
            return
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


class _CudaMemory:
    """Device memory at a raw address, as torch.as_tensor takes it (CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


class _MappedPool:
    """A receiver's pool as UCX mapped it onto our GPU, the kernel that copies pages of our
    pool into it, and the stream it runs on. Raises ValueError where the mapping is not on
    our GPU (a pool on another one, which our kernels cannot reach through it)."""

    def __init__(self, ptr: int, num_pages: int, pool: torch.Tensor) -> None:
        from pdserve.kernels.page_p2p_copy import PageCopier

        page = pool[0].numel() * pool.element_size()
        raw = torch.as_tensor(_CudaMemory(ptr, num_pages * page), device=pool.device)
        if raw.device != pool.device or raw.data_ptr() != ptr:
            raise ValueError(f"the mapping is on {raw.device}, our pool on {pool.device}")
        self.pool, self.dst = pool, raw.view(pool.dtype).view(num_pages, *pool.shape[1:])
        self.copier = PageCopier(pool, self.dst)
        self.stream = torch.cuda.Stream(device=pool.device)
        self._index(2 * int(pool.shape[0]))

    def _index(self, n: int) -> None:
        """Pinned and device buffers for `n` page indices, made once: a room's path
        allocates nothing."""
        self._host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self._host_np = self._host.numpy()
        self._dev = torch.empty(n, dtype=torch.int64, device=self.pool.device)

    def copy(self, src: np.ndarray, dst: np.ndarray, room: int = -1) -> None:
        """Our pages `src` into their pages `dst` (checked by the caller); back once they
        landed."""
        n = len(src)
        with torch.cuda.device(self.pool.device), torch.cuda.stream(self.stream):
            if 2 * n > self._host.numel():
                self._index(2 * n)
            self._host_np[:n], self._host_np[n:2 * n] = src, dst
            self._dev[:2 * n].copy_(self._host[:2 * n], non_blocking=True)
            self.copier(self._dev[:n], self._dev[n:2 * n])
            if room >= 0:
                stamp("issued", room)
            self.stream.synchronize()  # also: the pinned indices may be written again


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
