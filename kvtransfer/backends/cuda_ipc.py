"""`cuda_ipc` backend: same-host GPU pairs; the sender writes one-sided into the receiver's pool
through a CUDA IPC mapping (NVLink / PCIe peer copy), one copy per descriptor on a side stream.

The receiver shares its pool's IPC handle at handshake (torch's CUDA tensor reduction); the
sender maps it once per peer. As with shm, the sender validates destinations (the manager does)
and the chunk header follows over the control channel once the copies completed.
Ownership: the receiver's pool must outlive every peer mapping; the manager's abort handshake
guarantees no copy is in flight when decode reuses a failed room's pages.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

import torch
from pdserve.kvtransfer.engine import ChunkHeader, ReceiveHandler, TransferEngine
from torch.multiprocessing.reductions import reduce_tensor


class CudaIpcEngine(TransferEngine):
    name = "cuda_ipc"
    one_sided = True

    def __init__(self, **_: Any) -> None:
        super().__init__()
        self._peers: dict[str, torch.Tensor] = {}  # sender: mapped peer pools (not owned)
        self._stream: torch.cuda.Stream | None = None

    def start_receiver(self, handler: ReceiveHandler) -> dict[str, Any]:
        pool = self.region("kv")
        if not pool.is_cuda:
            raise ValueError("pool_buffer: the cuda_ipc backend needs the pool on a GPU")
        rebuild, args = reduce_tensor(pool)
        blob = base64.b64encode(pickle.dumps((rebuild, args))).decode()
        return {"handle": blob, "device_uuid": str(torch.cuda.get_device_properties(
            pool.device).uuid)}

    def _map(self, peer: str, info: dict[str, Any]) -> torch.Tensor:
        dst = self._peers.get(peer)
        if dst is None:
            # The blob comes from a peer that passed the handshake on our bootstrap endpoint.
            rebuild, args = pickle.loads(base64.b64decode(info["handle"]))
            dst = rebuild(*args)
            self._peers[peer] = dst
        return dst

    def write(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> None:
        src = self.region("kv")
        dst = self._map(peer, peer_info)
        if tuple(dst.shape[1:]) != tuple(src.shape[1:]) or dst.dtype != src.dtype:
            raise ValueError(f"peer {peer} pool pages {tuple(dst.shape[1:])} {dst.dtype} != "
                             f"local {tuple(src.shape[1:])} {src.dtype}")
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=src.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(src.device))  # pages written by prefill
        with torch.cuda.stream(stream):
            for d in header.descs:
                if d.dst_page <= 0 or d.dst_page + d.num_pages > dst.shape[0]:
                    raise ValueError(f"destination page {d.dst_page}+{d.num_pages} outside pool")
                dst[d.dst_page:d.dst_page + d.num_pages].copy_(
                    src[d.src_page:d.src_page + d.num_pages], non_blocking=True)
        stream.synchronize()  # the header goes out only once every byte landed

    def drop_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def close(self) -> None:
        self._peers.clear()
        self._stream = None
        super().close()
