"""A KV pool buffer in a uniquely named shared-memory segment (the same-host one-sided path).

The decode worker allocates its pool here; a prefill worker on the same host maps the segment by
name and writes the registered pages directly. Ownership: the creator unlinks the segment on
close(); a peer that only attached closes its mapping and never unlinks.
"""

from __future__ import annotations

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
        if create:
            self._shm = shared_memory.SharedMemory(
                name=name or f"{prefix}_{secrets.token_hex(8)}", create=True,
                size=max(1, nbytes))
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def alloc_shm_pool(num_pages: int, num_layers: int, page_size: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype) -> ShmPoolBuffer:
    """A page-major pool buffer in a fresh shared-memory segment; pass `.tensor` to
    `KVPool(buffer=...)` and `KVManager(pool_buffer=...)`, and close() it at shutdown."""
    return ShmPoolBuffer((num_pages, num_layers, 2, page_size, num_kv_heads, head_dim), dtype)
