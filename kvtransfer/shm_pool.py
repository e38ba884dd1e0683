"""A KV pool buffer in a uniquely named shared-memory segment (the same-host one-sided path).

The decode worker allocates its pool here; a prefill worker on the same host maps the segment by
name and writes the registered pages directly. Ownership: the creator unlinks the segment on
close(); a peer that only attached closes its mapping and never unlinks.

A creator killed outright (SIGKILL, OOM) cannot unlink, and shared memory is RAM. So each
segment has a companion `<name>.lock` that its creator holds an flock on for its lifetime; the
kernel drops the lock when the creator dies, however it dies. Every new pool first sweeps the
segments whose lock nobody holds (`sweep_stale_segments`), with their `<name>.sock` (the
same-host notification socket, backends/same_host.py, which holds such a lock too). flock works
across PID namespaces sharing /dev/shm, where a PID check would not.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import math
import mmap
import os
import secrets
import threading
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch
from typing_extensions import Self


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class ShmPoolBuffer:
    """Owns (create=True) or attaches to (name=..., create=False) a shared-memory segment viewed
    as a tensor of `shape`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, name: str | None = None,
                 create: bool = True, prefix: str = "pdkv") -> None:
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.owner = create
        nbytes = _nbytes(self.shape, dtype)
        self._shm: shared_memory.SharedMemory | None = None
        self._map: mmap.mmap | None = None
        self._lock_fd: int | None = None
        self._populator: tuple[threading.Thread, threading.Event] | None = None
        if create:
            name = name or f"{prefix}_{secrets.token_hex(8)}"
            self._lock_fd = hold_lock(name)
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, nbytes))
            self.name = self._shm.name
            buf: Any = self._shm.buf
        else:
            if name is None:
                raise ValueError("name: required to attach to an existing segment")
            # Map the file directly: attaching must not touch the resource tracker (a tracker
            # shared with the owner would otherwise unlink or forget the owner's segment).
            fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                if size < nbytes:
                    raise ValueError(f"name: segment {name} holds {size} bytes, need {nbytes}")
                # No MAP_POPULATE: populating a multi-GiB pool holds the GIL for seconds (the
                # heartbeat and gRPC threads stall) and commits memory the pool may never use.
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            self.name = name
            buf = self._map
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(
            0, dtype=torch.uint8)
        self.tensor: torch.Tensor = raw.view(dtype).view(self.shape)

    def populate_resident(self) -> None:
        """Map the segment's pages that are already in memory into this mapping, in a
        background thread. A peer writing into a fresh mapping otherwise takes a page fault per
        4 KiB page on first touch (~2 us each on the 2-core CI VM: ~45 ms for a 94 MB request,
        on the transfer's critical path). Pages not in memory yet are left alone: committing
        them is the owner's call, and they fault once when first written."""
        nbytes = self.tensor.numel() * self.tensor.element_size()
        if self._populator is not None or nbytes == 0:
            return
        stop = threading.Event()
        t = threading.Thread(target=_populate_resident, args=(self.tensor.data_ptr(), nbytes,
                                                              stop),
                             name="kv-shm-populate", daemon=True)
        self._populator = (t, stop)
        t.start()

    def close(self) -> None:
        """Drop the mapping; the owner also unlinks the name. Idempotent."""
        if self._populator is not None:
            self._populator[1].set()
            self._populator[0].join()
            self._populator = None
        self.tensor = torch.empty(0, dtype=self.dtype)
        shm, self._shm = self._shm, None
        mp, self._map = self._map, None
        try:
            if shm is not None:
                shm.close()
            if mp is not None:
                mp.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        if shm is not None and self.owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path(self.name))
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SHM_DIR = "/dev/shm"
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def _populate_resident(addr: int, nbytes: int, stop: threading.Event,
                       chunk: int = 32 << 20) -> None:
    """madvise(MADV_POPULATE_WRITE) over the runs of resident pages (mincore) of a mapping,
    chunk by chunk. ctypes calls release the GIL; the syscalls fail harmlessly (ENOMEM) on a
    range that is no longer mapped, and an older kernel (EINVAL) just ends the walk."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    madvise, mincore = libc.madvise, libc.mincore
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * (chunk // page))()
    for off in range(0, nbytes, chunk):
        n = min(chunk, nbytes - off)
        if stop.is_set() or mincore(addr + off, n, vec) != 0:
            return
        resident = (np.frombuffer(vec, dtype=np.uint8, count=-(-n // page)) & 1).astype(np.int8)
        edges = np.flatnonzero(np.diff(np.concatenate(([0], resident, [0]))))
        for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
            if madvise(addr + off + a * page, (b - a) * page, _MADV_POPULATE_WRITE) != 0:
                return


def lock_path(name: str) -> str:
    return f"{SHM_DIR}/{name.lstrip('/')}.lock"


def hold_lock(name: str) -> int | None:
    """Create and flock `<name>.lock`; the fd stays open (and locked) while we live."""
    if not os.path.isdir(SHM_DIR):
        return None
    fd = os.open(lock_path(name), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def sweep_stale_segments(prefix: str = "pdkv") -> list[str]:
    """Unlink the segments whose creator is gone (nobody holds their lock); returns their names.
    Segments with no lock file are left alone: nothing says whether their owner lives."""
    removed = []
    for lock in glob.glob(f"{SHM_DIR}/{prefix}_*.lock"):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its creator is alive
        finally:
            os.close(fd)
        name = os.path.basename(lock)[: -len(".lock")]
        for path in (f"{SHM_DIR}/{name}", f"{SHM_DIR}/{name}.sock", lock):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        removed.append(name)
    return removed


def alloc_shm_pool(num_pages: int, num_layers: int, page_size: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype) -> ShmPoolBuffer:
    """A page-major pool buffer in a fresh shared-memory segment; pass `.tensor` to
    `KVPool(buffer=...)` and `KVManager(pool_buffer=...)`, and close() it at shutdown.
    Segments left by creators that died are swept first."""
    sweep_stale_segments()
    return ShmPoolBuffer((num_pages, num_layers, 2, page_size, num_kv_heads, head_dim), dtype)
