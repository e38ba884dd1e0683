"""A KV pool buffer in a uniquely named shared-memory segment (the same-host one-sided path).

The decode worker allocates its pool here; a prefill worker on the same host maps the segment by
name and writes the registered pages directly. Ownership: the creator unlinks the segment on
close(); a peer that only attached closes its mapping and never unlinks.

A creator killed outright (SIGKILL, OOM) cannot unlink, and shared memory is RAM. So each
segment has a companion `<name>.lock` that its creator holds an flock on for its lifetime; the
kernel drops the lock when the creator dies, however it dies. Every new pool first sweeps the
segments whose lock nobody holds (`sweep_stale_segments`). flock works across PID namespaces
sharing /dev/shm, where a PID check would not.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import math
import mmap
import os
import secrets
from multiprocessing import shared_memory
from typing import Any

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
        if create:
            name = name or f"{prefix}_{secrets.token_hex(8)}"
            self._lock_fd = _hold_lock(name)
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

    def close(self) -> None:
        """Drop the mapping; the owner also unlinks the name. Idempotent."""
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
                os.unlink(_lock_path(self.name))
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SHM_DIR = "/dev/shm"


def _lock_path(name: str) -> str:
    return f"{SHM_DIR}/{name.lstrip('/')}.lock"


def _hold_lock(name: str) -> int | None:
    """Create and flock `<name>.lock`; the fd stays open (and locked) while we live."""
    if not os.path.isdir(SHM_DIR):
        return None
    fd = os.open(_lock_path(name), os.O_CREAT | os.O_RDWR, 0o600)
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
        for path in (f"{SHM_DIR}/{name}", lock):
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
