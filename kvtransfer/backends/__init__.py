"""Transport backends. `make_engine(name, ...)` builds one; imports are lazy so that a host
without ucxx, NIXL (or CUDA) can still use the others."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from pdserve.kvtransfer.engine import TransferEngine

log = logging.getLogger("pdserve.kvtransfer")

# Writes that only launch asynchronous device copies: cheap enough for the sender's thread.
INLINE_BACKENDS = frozenset({"cuda_ipc"})
# The sender writes decode's pages itself: decode cannot refuse bytes, so a room decode fails
# waits for prefill to confirm that no write of it is in flight before its pages are reused.
# (ucx puts where the receiver maps its pool, which it does unless PDSERVE_UCX_RMA=0; a
# two-sided ucx peer's abort merely waits for that confirmation too.)
ONE_SIDED_BACKENDS = frozenset({"shm", "cuda_ipc", "nixl", "ucx"})
# Backends whose connection to a peer is set up at handshake (engine.connect), so that the
# first room to a new peer does not pay for it.
CONNECT_AT_BOOTSTRAP = frozenset({"ucx", "nixl"})
# Backends that write a chunk's parts into the pools of a decode worker's tensor-parallel ranks
# (engine.write_lanes): the only ones for workers whose KV layouts differ or span several ranks.
LANE_BACKENDS = frozenset({"shm", "tcp", "cuda_ipc"})


def make_engine(name: str, **kwargs: Any) -> TransferEngine:
    if name == "tcp":
        from pdserve.kvtransfer.backends.tcp import TcpEngine

        return TcpEngine(**kwargs)
    if name == "shm":
        from pdserve.kvtransfer.backends.shm import ShmEngine

        return ShmEngine(**kwargs)
    if name == "ucx":
        from pdserve.kvtransfer.backends.ucx import UcxEngine

        return UcxEngine(**kwargs)
    if name == "cuda_ipc":
        from pdserve.kvtransfer.backends.cuda_ipc import CudaIpcEngine

        return CudaIpcEngine(**kwargs)
    if name == "nixl":
        from pdserve.kvtransfer.backends.nixl import NixlEngine

        return NixlEngine(**kwargs)
    raise ValueError(f"backend: unknown {name!r}")


def nixl_module_name() -> str | None:
    """The NIXL module to import here (the one matching torch's CUDA major first), or None."""
    import torch

    cuda = str(torch.version.cuda or "")
    order = ("nixl_cu13", "nixl_cu12") if cuda.startswith("13") else ("nixl_cu12", "nixl_cu13")
    for name in (*order, "nixl"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def importable(name: str) -> bool:
    """Whether this process has the package a backend needs (found, not imported: importing
    NIXL loads dozens of libraries; a broken install shows when the engine starts)."""
    if name == "ucx":
        return importlib.util.find_spec("ucxx") is not None
    if name == "nixl":
        return nixl_module_name() is not None
    if name == "cuda_ipc":
        import torch

        return torch.cuda.is_available()
    return name in ("shm", "tcp")


def available_backends() -> list[str]:
    """Backends usable in this process (ucx needs ucxx, nixl a NIXL wheel, cuda_ipc a GPU)."""
    out = [n for n in ("shm", "tcp", "ucx", "nixl", "cuda_ipc") if importable(n)]
    for n in ("ucx", "nixl"):
        if n not in out:
            log.info("%s backend unavailable: its package is not installed", n)
    return out
