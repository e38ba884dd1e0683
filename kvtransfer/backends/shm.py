"""`shm` backend: same-host pairs write one-sided into the receiver's pool, which lives in a
shared-memory segment (the host twin of the CUDA IPC path). No socket carries page bytes: the
sender validates destinations against the room's registration (the manager does, before
write()), copies, and sends the chunk header over the notification socket (same_host.py).

The copy: runs of pages consecutive on both sides become one memcpy each (numpy, GIL released),
split over two threads: the transfer thread and one worker. On the 2-core CI VM two threads
were as fast as one while another job held both cores and clearly faster when the cores were
free (a 94 MB request of scattered pages in 8 ms instead of ~11); more threads than two gained
nothing (docs/performance.md, KV transfer).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pdserve.kvtransfer.backends.same_host import SameHostEngine
from pdserve.kvtransfer.engine import ChunkHeader, ReceiveHandler
from pdserve.kvtransfer.hosts import machine_id
from pdserve.kvtransfer.lanes import HostLane, Part, assemble_pages, head_bytes
from pdserve.kvtransfer.rank_pools import PoolSet
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer


def _copy_runs(dst: np.ndarray, src: np.ndarray, runs: list[list[int]]) -> None:
    for s, d, n in runs:
        np.copyto(dst[d:d + n], src[s:s + n])


def split_runs(runs: list[list[int]], parts: int) -> list[list[list[int]]]:
    """Cut runs (src, dst, num) into `parts` lists of about equal page counts."""
    total = sum(n for _, _, n in runs)
    share = -(-total // parts)
    out: list[list[list[int]]] = [[]]
    room = share
    for s, d, n in runs:
        while n > 0:
            take = min(n, room)
            out[-1].append([s, d, take])
            s, d, n, room = s + take, d + take, n - take, room - take
            if room == 0 and len(out) < parts:
                out.append([])
                room = share
    return [p for p in out if p]


class ShmEngine(SameHostEngine):
    name = "shm"

    def __init__(self, shm_pool: ShmPoolBuffer | None = None, copy_threads: int = 0,
                 send_timeout_s: float = 30.0, lanes: PoolSet | None = None, **_: Any) -> None:
        super().__init__(send_timeout_s)
        self._shm_pool = shm_pool  # receiver: our pool's segment (owned by the caller)
        self._lanes = lanes  # receiver: every tensor-parallel rank's segment (rank 0's first)
        self._peers: dict[str, ShmPoolBuffer] = {}  # sender: peers' pools, attached (not owned)
        self._threads = copy_threads or min(2, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None  # the other copy workers

    @staticmethod
    def usable(peer_info: dict[str, Any]) -> bool:
        # The machine, not the announced host id: this is whether the segments can be mapped.
        names = [lane.get("name", "") for lane in peer_info.get("lanes") or [peer_info]]
        return peer_info.get("host") == machine_id() and all(
            os.path.exists(f"/dev/shm/{name.lstrip('/')}") for name in names)

    def start_receiver(self, handler: ReceiveHandler) -> dict[str, Any]:
        if self._shm_pool is None:
            raise ValueError("shm_pool: the shm backend needs the pool in shared memory "
                             "(alloc_shm_pool)")
        pool = self._shm_pool
        info: dict[str, Any] = {"name": pool.name, "shape": list(pool.shape),
                                "dtype": str(pool.dtype).removeprefix("torch."),
                                "host": machine_id(), **self._listen(handler)}
        if self._lanes is not None and self._lanes.layout.tp > 1:
            info["lanes"] = [{"name": h, "shape": list(t.shape),
                              "dtype": str(t.dtype).removeprefix("torch.")}
                             for t, h in zip(self._lanes.tensors, self._lanes.handles)]
        return info

    def _attach(self, peer: str, info: dict[str, Any]) -> torch.Tensor:
        buf = self._peers.get(peer)
        if buf is None:
            dtype = getattr(torch, info["dtype"])
            buf = ShmPoolBuffer(tuple(info["shape"]), dtype, name=info["name"], create=False)
            buf.populate_resident()
            self._peers[peer] = buf
        return buf.tensor

    def write(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> None:
        self._copy(peer, self.region("kv"), self._attach(peer, peer_info), header.descs)

    def write_lanes(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader,
                    parts: list[Part]) -> None:
        # Every part lands before write_lanes returns, so before the chunk's notification.
        by_lane: dict[int, list[Part]] = {}
        for part in parts:
            by_lane.setdefault(part.lane, []).append(part)
        lanes: list[HostLane] = []
        runs = None
        for lane, mine in by_lane.items():
            dst = self._attach(f"{peer}/{lane}", self.lane_info(peer_info, lane))
            if len(mine) == 1 and mine[0].heads is None:  # whole pages: plain memcpy
                self._copy(peer, mine[0].src, dst, mine[0].descs)
                continue
            for p in mine:  # every part has the chunk's descriptors: one list of runs
                runs = self._runs(peer, p.src, dst, p.descs, p.heads or (0, 0, dst.shape[4]))
            lanes.append((head_bytes(dst), [(head_bytes(p.src), *(p.heads or (
                0, 0, dst.shape[4]))) for p in mine]))
        if lanes and runs is not None:
            self._parallel(assemble_pages, lanes, None, runs.tolist())

    def _copy(self, peer: str, src: torch.Tensor, dst: torch.Tensor, descs: np.ndarray) -> None:
        runs = self._runs(peer, src, dst, descs)
        src_b = src.view(src.shape[0], -1).view(torch.uint8).numpy()
        dst_b = dst.view(dst.shape[0], -1).view(torch.uint8).numpy()
        self._parallel(_copy_runs, dst_b, src_b, runs.tolist())

    def _parallel(self, copy: Any, dst: Any, src: Any, runs: list[list[int]]) -> None:
        """copy(dst, src, runs) with the runs split over the copy threads (GIL released)."""
        parts = split_runs(runs, self._threads) if self._threads > 1 else []
        if len(parts) <= 1:
            copy(dst, src, runs)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads - 1, thread_name_prefix="kv-shm-copy")
        futures = [self._pool.submit(copy, dst, src, p) for p in parts[1:]]
        copy(dst, src, parts[0])  # this thread copies a share too
        for f in futures:
            f.result()

    def drop_peer(self, peer: str) -> None:
        super().drop_peer(peer)
        for key in [k for k in self._peers if k == peer or k.startswith(f"{peer}/")]:
            self._peers.pop(key).close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for peer in list(self._peers):
            self.drop_peer(peer)
        super().close()
