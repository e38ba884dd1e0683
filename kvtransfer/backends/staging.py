"""Staging for a message-based transport (ucx): a chunk cut into messages of at most
`message_bytes`, each gathered from the pool into a staging buffer on the sender and scattered
from one into the pool on the receiver.

IN_FLIGHT (two) buffers per side, used in turn, so that the copy for one message overlaps the
transport of the other: the sender gathers message k+1 while message k is on the wire (both
travel at once); the receiver's scatter of message k (a GPU kernel) runs while message k+1
arrives in the other buffer. On a GPU a gather or scatter is one launch of the page-copy kernel
(kernels/page_p2p_copy.py: int64 words; torch's index_select / index_copy_ where Triton is
missing). For 256 random 2 MiB pages on an H200 the kernel scattered in 0.285 ms against
index_copy_'s 0.746 (gathers: 0.287 against 0.278); on the host one memcpy per run of pages
(numpy, GIL released).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import torch

from pdserve.kernels.device import to_device
from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.descriptors import DST, NUM, SRC, run_pages

log = logging.getLogger("pdserve.kvtransfer")

# A message costs UCX's cuda_ipc path about a millisecond beyond its bytes: one 4096-token
# Llama-3-8B request (512 MiB) between two processes on one H200 moved at 51-55 GB/s as 64 MiB
# messages sent in turn, 71-83 as 256 MiB and 132-207 as one message (docs/performance.md). So
# a GPU message is up to 512 MiB, a chunk's messages are on the wire together, and only a
# chunk that needs a gather is cut in two (message_bytes).
GPU_PIECE_BYTES = 512 << 20
HOST_PIECE_BYTES = 16 << 20
IN_FLIGHT = 2  # messages on the wire at once (staging buffers per side)
MIN_SPLIT_BYTES = 16 << 20  # a GPU chunk smaller than IN_FLIGHT of these goes as one message


async def event_done(ev: torch.cuda.Event | None) -> None:
    """Until the work before `ev` has run on the GPU, without blocking the loop's other tasks
    (a timed sleep would idle at least epoll's 1 ms tick)."""
    while ev is not None and not ev.query():
        await asyncio.sleep(0)


def piece_bytes(pool: torch.Tensor, configured: int) -> int:
    """Bytes per message at most: the configured size, else the device's default; at least one
    page, at most the pool (no chunk is larger)."""
    page = pool[0].numel() * pool.element_size()
    size = configured or (GPU_PIECE_BYTES if pool.is_cuda else HOST_PIECE_BYTES)
    return max(page, min(size, pool.numel() * pool.element_size()))


def message_bytes(pool: torch.Tensor, configured: int, total: int, contiguous: bool = False,
                  gpu: bool | None = None) -> int:
    """Bytes per message for a chunk of `total` bytes. On a GPU, unless configured, a chunk
    whose pages must be gathered goes as IN_FLIGHT messages of equal size, so that the gather
    of one overlaps the other's transfer (135 -> 142 GB/s for a scattered 4096-token request);
    one that is a single run of pages (sent from the pool, nothing to gather) goes whole, one
    message being cheaper (207 against 186 GB/s as halves; docs/performance.md). Each message
    is at most GPU_PIECE_BYTES; a small chunk goes whole. (`gpu` stands for `pool.is_cuda` in
    tests.)"""
    gpu = pool.is_cuda if gpu is None else gpu
    cap = GPU_PIECE_BYTES if gpu and not configured else piece_bytes(pool, configured)
    if configured or not gpu or contiguous or total < IN_FLIGHT * MIN_SPLIT_BYTES:
        return cap
    page = pool[0].numel() * pool.element_size()
    pages = -(-total // page)
    return max(page, min(cap, -(-pages // IN_FLIGHT) * page))


def split(header: ChunkHeader, page_bytes: int, max_bytes: int) -> list[ChunkHeader]:
    """The chunk as consecutive pieces of at most `max_bytes` each (at least one page), a
    descriptor cut where a piece ends inside it; only the final piece keeps `last` and the aux
    data."""
    d = header.descs
    if len(d) == 0:
        return [header]
    room = max(1, max_bytes // page_bytes)  # pages per piece
    groups: list[list[list[int]]] = [[]]
    left = room
    for src, dst, num, pos in d.tolist():
        while num > 0:
            if left == 0:
                groups.append([])
                left = room
            k = min(num, left)
            groups[-1].append([src, dst, k, pos])
            src, dst, num, pos, left = src + k, dst + k, num - k, pos + k, left - k
    out = []
    for k, rows in enumerate(groups):
        final = k == len(groups) - 1
        out.append(ChunkHeader(header.room, header.seq, np.asarray(rows, dtype=np.int64),
                               header.last and final, header.aux if final else None))
    return out


def one_run(pages: np.ndarray) -> bool:
    return len(pages) > 0 and int(pages[-1]) - int(pages[0]) == len(pages) - 1 and bool(
        np.all(np.diff(pages) == 1))


def _rows(t: torch.Tensor) -> np.ndarray:
    """A host tensor as a numpy byte matrix, one row per page (zero-copy)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8).numpy()


_kernel_ok = True  # False once Triton failed to import or launch: torch's index ops from then on

Copiers = dict  # (source pointer, destination pointer) -> PageCopier, kept by a buffer's owner


def _copier(src: torch.Tensor, dst: torch.Tensor, cache: Copiers | None) -> object:
    """The PageCopier for this pair of buffers: built once per pair where the caller keeps a
    cache (its checks and views cost more than the launch)."""
    from pdserve.kernels.page_p2p_copy import PageCopier

    if cache is None:
        return PageCopier(src, dst)
    key = (src.data_ptr(), tuple(src.shape), dst.data_ptr(), tuple(dst.shape))
    c = cache.get(key)
    if c is None:
        c = cache[key] = PageCopier(src, dst)
    return c


def copy_index(src_pages: np.ndarray, dst_pages: np.ndarray,
               device: torch.device) -> torch.Tensor:
    """The page lists of one copy as a [2, n] int64 tensor on `device` (uploaded without
    blocking), so that it can be made before the copy is due. Its rows are padded to an even
    length, so that both start 16-byte aligned whatever n is: Triton compiles a kernel per
    pointer alignment, and the handshake's one-page warm-up must run the specialization a
    room's copies take, not leave its compilation to the first room."""
    n = len(src_pages)
    both = np.zeros((2, n + n % 2), dtype=np.int64)
    both[0, :n], both[1, :n] = src_pages, dst_pages
    return to_device(torch.from_numpy(both), device)[:, :n]


def _kernel_copy(src: torch.Tensor, dst: torch.Tensor, src_pages: np.ndarray,
                 dst_pages: np.ndarray, cache: Copiers | None = None,
                 idx: torch.Tensor | None = None) -> bool:
    """dst[dst_pages[i]] = src[src_pages[i]] in one page-copy launch on the current stream;
    False where the kernel is not available (the caller uses torch). `idx`: the page lists
    already on the device (copy_index)."""
    global _kernel_ok
    if not _kernel_ok:
        return False
    try:
        with torch.cuda.device(src.device):
            if idx is None:
                idx = copy_index(src_pages, dst_pages, src.device)
            _copier(src, dst, cache)(idx[0], idx[1])
        return True
    except (ImportError, RuntimeError, ValueError) as e:
        log.warning("ucx staging: page-copy kernel unavailable (%s); torch index copies", e)
        _kernel_ok = False
        return False


def gather(pool: torch.Tensor, descs: np.ndarray, out: torch.Tensor,
           cache: Copiers | None = None) -> torch.Tensor:
    """out[:n] = the descriptors' source pages in order; returns that view. On a GPU the
    caller synchronizes before a transport reads it."""
    n = int(descs[:, NUM].sum())
    dst = out[:n]
    if pool.is_cuda:
        src_pages = run_pages(descs, SRC)
        if not _kernel_copy(pool, out, src_pages, np.arange(n, dtype=np.int64), cache):
            idx = to_device(torch.from_numpy(src_pages), pool.device)
            torch.index_select(pool, 0, idx, out=dst)
        return dst
    src_b, out_b = _rows(pool), _rows(dst)
    off = 0
    for s, num in descs[:, [SRC, NUM]].tolist():
        np.copyto(out_b[off:off + num], src_b[s:s + num])
        off += num
    return dst


def scatter_index(pool: torch.Tensor, descs: np.ndarray) -> torch.Tensor | None:
    """What `scatter` of these descriptors uploads, made ahead (None off the GPU)."""
    if not pool.is_cuda or not _kernel_ok:
        return None
    dst_pages = run_pages(descs, DST)
    return copy_index(np.arange(len(dst_pages), dtype=np.int64), dst_pages, pool.device)


def scatter(stage: torch.Tensor, pool: torch.Tensor, descs: np.ndarray,
            cache: Copiers | None = None, idx: torch.Tensor | None = None) -> None:
    """pool[destination pages] = stage rows in order (asynchronous on a GPU: the pool's later
    users on the same device stream run after it). `idx`: from scatter_index."""
    if pool.is_cuda:
        dst_pages = run_pages(descs, DST)
        n = len(dst_pages)
        if not _kernel_copy(stage, pool, np.arange(n, dtype=np.int64), dst_pages, cache, idx):
            idx = to_device(torch.from_numpy(dst_pages), pool.device)
            pool.index_copy_(0, idx, stage[:n])
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
        _warm_pinned(stage.shape[0])


def _warm_pinned(pages: int) -> None:
    """Pinned host blocks of every size an index of up to `pages` pages is uploaded through
    (copy_index: torch's caching host allocator keeps one free list per power of two), made
    and freed, so that a room's first upload of a size reuses a block instead of paying for
    cudaHostAlloc inside the room."""
    size = 32
    while size < 16 * (pages + 2):
        torch.empty(size, dtype=torch.uint8, pin_memory=True)
        size *= 2
    torch.empty(size, dtype=torch.uint8, pin_memory=True)


class RecvRing:
    """The receiver's IN_FLIGHT staging buffers (bytes) of one size, made up front so that the
    buffers the handshake's warm-up reached are the ones a request's messages land in (a buffer
    made later is a new allocation: on a GPU, a new CUDA IPC mapping on the sender's side, tens
    of milliseconds inside the first room), and so that a receive can be posted into each
    before its message is announced. Message k lands in buffer k % IN_FLIGHT. On a GPU an
    event after each scatter says when its buffer may take the next message."""

    def __init__(self, pool: torch.Tensor, nbytes: int) -> None:
        self._pool = pool
        page = pool[0].numel() * pool.element_size()
        self.nbytes = max(1, -(-nbytes // page)) * page
        self._bufs: list[torch.Tensor] = []  # made at the first use (none for one-sided peers)
        self._events: list[torch.cuda.Event | None] = [None] * IN_FLIGHT
        self.copiers: Copiers = {}  # the scatter kernels of the whole buffers into the pool

    def buf(self, b: int) -> torch.Tensor:
        if not self._bufs:
            self._bufs = [torch.empty(self.nbytes, dtype=torch.uint8, device=self._pool.device)
                          for _ in range(IN_FLIGHT)]
        return self._bufs[b]

    def scattered(self, b: int) -> torch.cuda.Event | None:
        """Record that buffer b's scatter was issued; the event that says when it has run."""
        if not self._pool.is_cuda:
            return None
        ev = self._events[b] = self._events[b] or torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self._pool.device))
        return ev

    def pages(self, buf: torch.Tensor) -> torch.Tensor:
        pool = self._pool
        return buf.view(pool.dtype).view(-1, *pool.shape[1:])

    def whole(self, b: int) -> torch.Tensor:
        """Buffer b whole, as pages: what a scatter from it reads (one copier per buffer)."""
        return self.pages(self.buf(b))
