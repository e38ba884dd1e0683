"""`shm` backend: same-host pairs write one-sided into the receiver's pool, which lives in a
shared-memory segment (the host twin of the CUDA IPC path). One memcpy per descriptor; no
socket carries page bytes. The sender validates destinations against the room's registration
(the manager does, before write()), and the chunk header follows over the control channel.
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pdserve.kvtransfer.engine import ChunkHeader, ReceiveHandler, TransferEngine
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer


def host_id() -> str:
    """Identifies this host's shared-memory namespace (hostname + boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _copy_all(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in copies:
        np.copyto(dst, src)


class ShmEngine(TransferEngine):
    name = "shm"
    one_sided = True

    def __init__(self, shm_pool: ShmPoolBuffer | None = None, copy_threads: int = 2,
                 **_: Any) -> None:
        super().__init__()
        self._shm_pool = shm_pool  # receiver: our pool's segment (owned by the caller)
        self._peers: dict[str, ShmPoolBuffer] = {}  # sender: peers' pools, attached (not owned)
        self._threads = max(1, min(copy_threads, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None  # copy workers (the transfer thread's)

    @staticmethod
    def usable(peer_info: dict[str, Any]) -> bool:
        return peer_info.get("host") == host_id() and os.path.exists(
            f"/dev/shm/{peer_info.get('name', '').lstrip('/')}")

    def start_receiver(self, handler: ReceiveHandler) -> dict[str, Any]:
        if self._shm_pool is None:
            raise ValueError("shm_pool: the shm backend needs the pool in shared memory "
                             "(alloc_shm_pool)")
        pool = self._shm_pool
        return {"name": pool.name, "shape": list(pool.shape),
                "dtype": str(pool.dtype).removeprefix("torch."), "host": host_id()}

    def _attach(self, peer: str, info: dict[str, Any]) -> torch.Tensor:
        buf = self._peers.get(peer)
        if buf is None:
            dtype = getattr(torch, info["dtype"])
            buf = ShmPoolBuffer(tuple(info["shape"]), dtype, name=info["name"], create=False)
            self._peers[peer] = buf
        return buf.tensor

    def write(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> None:
        src = self.region("kv")
        dst = self._attach(peer, peer_info)
        if tuple(dst.shape[1:]) != tuple(src.shape[1:]) or dst.dtype != src.dtype:
            raise ValueError(f"shm pool of peer {peer}: page shape {tuple(dst.shape[1:])} "
                             f"{dst.dtype} != local {tuple(src.shape[1:])} {src.dtype}")
        for d in header.descs:
            if d.dst_page <= 0 or d.dst_page + d.num_pages > dst.shape[0]:
                raise ValueError(f"destination page {d.dst_page}+{d.num_pages} outside pool")
        # numpy's copy is a plain memcpy with the GIL released: ~2x torch's per-call cost on
        # small runs; two threads keep both memory channels busy on scattered pages.
        src_b = src.view(src.shape[0], -1).view(torch.uint8).numpy()
        dst_b = dst.view(dst.shape[0], -1).view(torch.uint8).numpy()
        copies = [(dst_b[d.dst_page:d.dst_page + d.num_pages],
                   src_b[d.src_page:d.src_page + d.num_pages]) for d in header.descs]
        if self._threads <= 1 or len(copies) < 2:
            _copy_all(copies)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kv-shm-copy")
        parts = [copies[k::self._threads] for k in range(self._threads)]
        for f in [self._pool.submit(_copy_all, part) for part in parts]:
            f.result()

    def drop_peer(self, peer: str) -> None:
        buf = self._peers.pop(peer, None)
        if buf is not None:
            buf.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for peer in list(self._peers):
            self.drop_peer(peer)
        super().close()
