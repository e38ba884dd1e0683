"""Transport backends. `make_engine(name, ...)` builds one; imports are lazy so that a host
without ucxx (or CUDA) can still use the others."""

from __future__ import annotations

import logging
from typing import Any

from pdserve.kvtransfer.engine import TransferEngine

log = logging.getLogger("pdserve.kvtransfer")

# Writes that only launch asynchronous device copies: cheap enough for the sender's thread.
INLINE_BACKENDS = frozenset({"cuda_ipc"})


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
    raise ValueError(f"backend: unknown {name!r}")


def available_backends() -> list[str]:
    """Backends usable in this process (ucx needs ucxx, cuda_ipc needs a GPU)."""
    out = ["shm", "tcp"]
    try:
        import ucxx  # noqa: F401

        out.append("ucx")
    except ImportError:
        log.info("ucx backend unavailable: ucxx does not import")
    import torch

    if torch.cuda.is_available():
        out.append("cuda_ipc")
    return out
