"""`cuda_ipc` backend: same-host GPU pairs; the sender writes one-sided into the receiver's pool
through a CUDA IPC mapping (NVLink / PCIe peer access), on side streams.

How pages move (TransferConfig.ipc_copy): a chunk of a few runs is one peer copy per run;
scattered pages go through one Triton kernel, launched by the sender on the receiver's GPU,
that reads every page of the sender's pool over NVLink and stores it into the receiver's pool
("auto", "triton"; kernels/page_p2p_copy.py), or gather -> one peer copy -> scatter
("staged", and wherever Triton does not import or refuses the launch). "triton" uses the
kernel for every chunk, to compare it with plain peer copies.

The receiver shares its pool's IPC handle at handshake (torch's CUDA tensor reduction); the
sender maps it once per peer. As with shm, the sender validates destinations (the manager does)
and the chunk header follows over the notification socket (same_host.py); write() only issues
the copies and the notification carries an IPC event that the receiver waits on before it
counts the pages, so the control path overlaps the copy.
Ownership: the receiver's pool must outlive every peer mapping; the manager's abort handshake
guarantees no copy is in flight when decode reuses a failed room's pages.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import reduce_tensor

from pdserve.kernels.device import to_device
from pdserve.kvtransfer import trace
from pdserve.kvtransfer.backends.same_host import SameHostEngine
from pdserve.kvtransfer.config import IPC_COPIES
from pdserve.kvtransfer.descriptors import DST, SRC, run_pages
from pdserve.kvtransfer.engine import ChunkHeader, ReceiveHandler
from pdserve.kvtransfer.lanes import Part
from pdserve.kvtransfer.rank_pools import PoolSet

log = logging.getLogger("pdserve.kvtransfer")
_DIRECT_MAX_DESCS = 8  # up to this many runs: one peer copy each (no kernel, no staging)
_STAGING_PAGES = 256  # pages per gather / peer copy / scatter piece (ipc_copy="staged")


def _p2p_copier(src: torch.Tensor, dst: torch.Tensor) -> Callable[..., None] | None:
    """A kernels.page_p2p_copy.PageCopier for the two pools run on the destination's GPU, or
    None where Triton does not import. On the destination's GPU because the peer's pool is
    mapped from its IPC handle, which only that GPU's kernels reached on two H200s (launched
    from the source GPU, Triton refused the pointer with peer access enabled before or after
    the handle was opened, and a kernel given the address as an integer faulted); the kernel
    reads the local pool over NVLink instead."""
    try:
        from pdserve.kernels.page_p2p_copy import PageCopier
    except ImportError as e:
        log.warning("cuda_ipc: Triton page copy unavailable (%s); staged copies", e)
        return None
    return PageCopier(src, dst, device=dst.device)


def enable_peer_access(a: int, b: int) -> None:
    """cudaDeviceEnablePeerAccess both ways. Copies into memory mapped from another process's
    IPC handle do not turn peer access on by themselves: without this, torch's copy to such
    memory was seen at ~38 GB/s between two H200s instead of ~387 GB/s over NVLink."""
    if a == b or a < 0 or b < 0:
        return
    cudart = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            cudart = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if cudart is None:
        log.warning("cuda_ipc: libcudart not found; peer copies may be slow")
        return
    current = torch.cuda.current_device()
    try:
        for x, y in ((a, b), (b, a)):
            torch.cuda.set_device(x)
            rc = cudart.cudaDeviceEnablePeerAccess(ctypes.c_int(y), ctypes.c_uint(0))
            if rc != 0:
                # Clear it, or the next runtime call reports it (704, "peer access is already
                # enabled", failed the Triton launch that followed).
                cudart.cudaGetLastError()
            if rc not in (0, 704):  # 704: already enabled
                log.warning("cuda_ipc: cudaDeviceEnablePeerAccess(%d->%d) = %d", x, y, rc)
    finally:
        torch.cuda.set_device(current)


def _uuid(t: torch.Tensor) -> str:
    return str(torch.cuda.get_device_properties(t.device).uuid)


def _device_of(uuid: str) -> int:
    """Index of the visible GPU with this UUID (the peer pool's device), else -1."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return -1


class CudaIpcEngine(SameHostEngine):
    name = "cuda_ipc"

    def __init__(self, ipc_copy: str = "auto", send_timeout_s: float = 30.0,
                 lanes: PoolSet | None = None, **_: Any) -> None:
        super().__init__(send_timeout_s)
        self._lanes = lanes  # receiver: every tensor-parallel rank's pool (rank 0's first)
        if ipc_copy not in IPC_COPIES:
            raise ValueError(f"ipc_copy: {ipc_copy!r} is not one of {IPC_COPIES}")
        self.ipc_copy = ipc_copy
        self._peers: dict[str, torch.Tensor] = {}  # sender: mapped peer pools (not owned)
        self._copiers: dict[str, Callable[..., None] | None] = {}  # per peer, Triton path
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._stage: tuple[torch.Tensor, torch.Tensor] | None = None  # src-GPU, dst-GPU
        self._event: torch.cuda.Event | None = None  # sender: last chunk's copies done
        self._event_handle = b""  # its IPC handle, sent with every chunk
        self._peer_events: dict[bytes, torch.cuda.Event] = {}  # receiver: opened handles

    def start_receiver(self, handler: ReceiveHandler) -> dict[str, Any]:
        pool = self.region("kv")
        if not pool.is_cuda:
            raise ValueError("pool_buffer: the cuda_ipc backend needs the pool on a GPU")
        rebuild, args = reduce_tensor(pool)
        blob = base64.b64encode(pickle.dumps((rebuild, args))).decode()
        info: dict[str, Any] = {"handle": blob, "device_uuid": _uuid(pool),
                                **self._listen(handler)}
        if self._lanes is not None and self._lanes.layout.tp > 1:
            # The other ranks' pools by the handles they exported (rank_pools.IpcShare).
            info["lanes"] = [{"handle": blob if r == 0 else h, "device_uuid": _uuid(t)}
                             for r, (t, h) in enumerate(zip(self._lanes.tensors,
                                                            self._lanes.handles))]
        return info

    def write_lanes(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader,
                    parts: list[Part]) -> None:
        """Each part's runs (or their range of heads) by peer copies into its rank's pool, then
        waits for them: the parts come from several GPUs (this worker's ranks), so they are
        finished here rather than tracked by the completion event."""
        for part in parts:
            dst = self._map(f"{peer}/{part.lane}", self.lane_info(peer_info, part.lane))
            src = part.src
            torch.cuda.current_stream(src.device).synchronize()  # the pages are written
            with torch.cuda.device(dst.device):
                if part.heads is not None:
                    self._copy_heads(peer, src, dst, part.descs, part.heads)
                else:
                    for sp, dp, n in self._runs(peer, src, dst, part.descs).tolist():
                        dst[dp:dp + n].copy_(src[sp:sp + n], non_blocking=True)
                torch.cuda.current_stream(dst.device).synchronize()

    def _map(self, peer: str, info: dict[str, Any]) -> torch.Tensor:
        dst = self._peers.get(peer)
        if dst is None:
            # The blob comes from a peer that passed the handshake on our bootstrap endpoint.
            rebuild, args = pickle.loads(base64.b64decode(info["handle"]))
            local = self.region("kv").device.index or 0
            # Peer access both ways, enabled before the handle is opened and checked after
            # (then a no-op): the order of the runs measured on two H200s. It makes peer
            # copies run at NVLink speed and lets the kernel on the peer's GPU read our pool;
            # it does not make the mapped pool reachable from our GPU's kernels.
            enable_peer_access(local, _device_of(str(info.get("device_uuid", ""))))
            dst = rebuild(*args)
            enable_peer_access(local, dst.device.index or 0)
            self._peers[peer] = dst
        return dst

    def write(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> None:
        src = self.region("kv")
        dst = self._map(peer, peer_info)
        runs = self._runs(peer, src, dst, header.descs)
        trace.stamp("mapped", header.room)
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device=src.device),
                             torch.cuda.Stream(device=dst.device))
            # Recorded after each chunk's last copy; the receiver waits on it through its IPC
            # handle, so the control path overlaps the copy instead of following it.
            self._event = torch.cuda.Event(interprocess=True)
        s_src, s_dst = self._streams
        s_src.wait_stream(torch.cuda.current_stream(src.device))  # pages written by prefill
        s_dst.wait_stream(s_src)
        timing = trace.gpu_timer(s_dst)
        few = len(runs) <= _DIRECT_MAX_DESCS
        copied = ((self.ipc_copy == "triton" or (self.ipc_copy == "auto" and not few))
                  and self._kernel_copy(peer, src, dst, header, s_dst))
        if not copied and few:
            with torch.cuda.stream(s_src):
                for sp, dp, n in runs.tolist():
                    dst[dp:dp + n].copy_(src[sp:sp + n], non_blocking=True)
        elif not copied:
            self._staged_copy(src, dst, header, s_src, s_dst)
        s_dst.wait_stream(s_src)
        if timing is not None:
            timing.done(header.room, s_dst)
        event = self._event
        if event is None:
            raise RuntimeError("cuda_ipc: completion event missing")
        with torch.cuda.device(dst.device):
            event.record(s_dst)

    def _kernel_copy(self, peer: str, src: torch.Tensor, dst: torch.Tensor,
                     header: ChunkHeader, stream: torch.cuda.Stream) -> bool:
        """One launch on the destination GPU (`stream` is on it): the local pool read over
        NVLink, stored into the peer's pages. False (and staged copies from then on) where
        Triton does not import or refuses the launch."""
        if peer not in self._copiers:
            self._copiers[peer] = _p2p_copier(src, dst)
        copier = self._copiers[peer]
        if copier is None:
            self.ipc_copy = "staged"
            return False
        pages = np.stack([run_pages(header.descs, SRC), run_pages(header.descs, DST)])
        try:
            with torch.cuda.device(dst.device), torch.cuda.stream(stream):
                # Pinned, asynchronous: an upload from pageable memory would wait for the
                # previous chunk's copy on this stream.
                idx = to_device(torch.from_numpy(pages), dst.device)
                trace.stamp("uploaded", header.room)
                copier(idx[0], idx[1])
                trace.stamp("kernel", header.room)
        except (RuntimeError, ValueError) as e:  # e.g. a launcher refusing the peer pointer
            log.warning("cuda_ipc: Triton page copy failed (%s); staged copies from now on", e)
            self._copiers.clear()
            self.ipc_copy = "staged"
            return False
        return True

    def _staged_copy(self, src: torch.Tensor, dst: torch.Tensor, header: ChunkHeader,
                     s_src: torch.cuda.Stream, s_dst: torch.cuda.Stream) -> None:
        """Scattered pages: gather on the source GPU, one peer copy, scatter on the
        destination GPU: three kernels per piece instead of one copy per descriptor."""
        src_pages = run_pages(header.descs, SRC)
        dst_pages = run_pages(header.descs, DST)
        piece = _STAGING_PAGES
        for lo in range(0, len(src_pages), piece):
            n = min(piece, len(src_pages) - lo)
            stage_src, stage_dst = self._staging(src, dst, min(piece, len(src_pages)))
            with torch.cuda.stream(s_src):
                idx = to_device(torch.from_numpy(src_pages[lo:lo + n]), src.device)
                torch.index_select(src, 0, idx, out=stage_src[:n])
            s_dst.wait_stream(s_src)
            with torch.cuda.stream(s_dst):
                stage_dst[:n].copy_(stage_src[:n], non_blocking=True)
                jdx = to_device(torch.from_numpy(dst_pages[lo:lo + n]), dst.device)
                dst.index_copy_(0, jdx, stage_dst[:n])
            s_src.wait_stream(s_dst)  # the next piece reuses both staging buffers

    def completion(self) -> bytes:
        if self._event is None:
            return b""
        if not self._event_handle:  # one event for every chunk: its handle never changes
            self._event_handle = bytes(self._event.ipc_handle())
        return self._event_handle

    def quiesce(self) -> None:
        for stream in self._streams or ():
            stream.synchronize()

    def wait_completion(self, token: bytes) -> None:
        ev = self._peer_events.get(token)
        if ev is None:
            ev = torch.cuda.Event.from_ipc_handle(self.region("kv").device, token)
            self._peer_events[token] = ev
        ev.synchronize()

    def _staging(self, src: torch.Tensor, dst: torch.Tensor,
                 pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stage is None or self._stage[0].shape[0] < pages:
            shape = (pages, *src.shape[1:])
            self._stage = (torch.empty(shape, dtype=src.dtype, device=src.device),
                           torch.empty(shape, dtype=dst.dtype, device=dst.device))
        return self._stage

    def drop_peer(self, peer: str) -> None:
        super().drop_peer(peer)
        for key in [k for k in self._peers if k == peer or k.startswith(f"{peer}/")]:
            self._peers.pop(key, None)
        self._copiers.pop(peer, None)

    def close(self) -> None:
        self._peers.clear()
        self._copiers.clear()
        self.quiesce()
        self._streams = None
        self._stage = None
        self._event = None
        self._peer_events.clear()
        super().close()
