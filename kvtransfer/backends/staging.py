"""Staging for a message-based transport (ucx): a chunk cut into messages of at most
`piece_bytes`, each gathered from the pool into a staging buffer on the sender and scattered
from one into the pool on the receiver.

Two buffers per side, used in turn, so that the copy for one message overlaps the transport of
the other: the sender gathers message k+1 while message k is on the wire; the receiver's
scatter of message k (a GPU kernel) runs while message k+1 arrives in the other buffer. On a
GPU a gather or scatter is one index kernel; on the host one memcpy per run of pages (numpy,
GIL released).
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from pdserve.kernels.device import to_device
from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.descriptors import DST, NUM, SRC, run_pages

# A message costs UCX's cuda_ipc path far more than its bytes: one 4096-token Llama-3-8B request
# (512 MiB) between two processes on one H200 moved at 51-55 GB/s as 64 MiB messages, 71-83 as
# 256 MiB and 132-201 as one message (docs/performance.md). So a GPU chunk goes whole up to
# 512 MiB (a 2,048-token prefill chunk of that model is 256 MiB).
GPU_PIECE_BYTES = 512 << 20
HOST_PIECE_BYTES = 16 << 20


def piece_bytes(pool: torch.Tensor, configured: int) -> int:
    """Bytes per message: the configured size, else the device's default; at least one page,
    at most the pool (no chunk is larger)."""
    page = pool[0].numel() * pool.element_size()
    size = configured or (GPU_PIECE_BYTES if pool.is_cuda else HOST_PIECE_BYTES)
    return max(page, min(size, pool.numel() * pool.element_size()))


def split(header: ChunkHeader, page_bytes: int, max_bytes: int) -> list[ChunkHeader]:
    """The chunk as consecutive pieces of whole descriptors, each of at most `max_bytes` (a
    larger descriptor alone); only the final piece keeps `last` and the aux data."""
    d = header.descs
    if len(d) == 0:
        return [header]
    ends = np.cumsum(d[:, NUM]) * page_bytes
    cuts, start, base = [], 0, 0
    for i, end in enumerate(ends.tolist()):
        if i > start and end - base > max_bytes:
            cuts.append((start, i))
            start, base = i, ends[i - 1]
    cuts.append((start, len(d)))
    out = []
    for k, (a, b) in enumerate(cuts):
        final = k == len(cuts) - 1
        out.append(ChunkHeader(header.room, header.seq, d[a:b], header.last and final,
                               header.aux if final else None))
    return out


def one_run(pages: np.ndarray) -> bool:
    return len(pages) > 0 and int(pages[-1]) - int(pages[0]) == len(pages) - 1 and bool(
        np.all(np.diff(pages) == 1))


def _rows(t: torch.Tensor) -> np.ndarray:
    """A host tensor as a numpy byte matrix, one row per page (zero-copy)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8).numpy()


def gather(pool: torch.Tensor, descs: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """out[:n] = the descriptors' source pages in order; returns that view. On a GPU the
    caller synchronizes before a transport reads it."""
    n = int(descs[:, NUM].sum())
    dst = out[:n]
    if pool.is_cuda:
        idx = to_device(torch.from_numpy(run_pages(descs, SRC)), pool.device)
        torch.index_select(pool, 0, idx, out=dst)
        return dst
    src_b, out_b = _rows(pool), _rows(dst)
    off = 0
    for s, num in descs[:, [SRC, NUM]].tolist():
        np.copyto(out_b[off:off + num], src_b[s:s + num])
        off += num
    return dst


def scatter(stage: torch.Tensor, pool: torch.Tensor, descs: np.ndarray) -> None:
    """pool[destination pages] = stage rows in order (asynchronous on a GPU: the pool's later
    users on the same device stream run after it)."""
    if pool.is_cuda:
        idx = to_device(torch.from_numpy(run_pages(descs, DST)), pool.device)
        pool.index_copy_(0, idx, stage[:len(idx)])
        return
    st_b, pool_b = _rows(stage), _rows(pool)
    off = 0
    for d, num in descs[:, [DST, NUM]].tolist():
        np.copyto(pool_b[d:d + num], st_b[off:off + num])
        off += num


def warm_copies(pool: torch.Tensor, stage: torch.Tensor) -> None:
    """Run the gather and the scatter once, so that a request's first message does not pay for
    their first use (CUDA module loading, pinned upload buffers). Reads the pool's page 0,
    writes only `stage`."""
    d = np.array([[0, 0, 1, 0]], dtype=np.int64)
    gather(pool, d, stage)
    scatter(stage[:1].clone(), stage, d)
    if pool.is_cuda:
        torch.cuda.current_stream(pool.device).synchronize()


class RecvRing:
    """The receiver's two staging buffers (bytes, grown on demand). On a GPU an event after
    each scatter says when its buffer may take the next message."""

    def __init__(self, pool: torch.Tensor) -> None:
        self._pool = pool
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._k = 0

    async def next(self, nbytes: int) -> torch.Tensor:
        b = self._k = (self._k + 1) % 2
        ev = self._events[b]
        while ev is not None and not ev.query():  # its previous scatter still runs
            await asyncio.sleep(0.0001)
        buf = self._bufs[b]
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[b] = torch.empty(max(nbytes, 1), dtype=torch.uint8,
                                              device=self._pool.device)
        return buf[:nbytes]

    def scattered(self) -> None:
        """Record that the current buffer's scatter was issued."""
        if self._pool.is_cuda:
            ev = self._events[self._k] = self._events[self._k] or torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self._pool.device))

    def pages(self, buf: torch.Tensor) -> torch.Tensor:
        pool = self._pool
        return buf.view(pool.dtype).view(-1, *pool.shape[1:])
