"""Whether the model's elementwise ops run as fused Triton kernels (kernels/fused_norm.py,
rope.py, silu_mul.py) or as plain torch, and whether a one-token decode step runs through the
fused matrix-vector kernels (kernels/gemv.py, engine/models/decode_gemv.py).

Fused on CUDA when Triton imports; plain torch on CPU, with PDSERVE_FUSED_OPS=0, or inside
`fused_ops(False)` (the torch reference the GPU tests compare against). The batch-1 GEMV path
additionally needs PDSERVE_DECODE_GEMV unset or 1 and no `decode_gemv(False)`. A CUDA graph
keeps what was chosen when it was captured.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import SimpleNamespace

import torch

_enabled = {"ops": os.environ.get("PDSERVE_FUSED_OPS", "1") != "0",
            "gemv": os.environ.get("PDSERVE_DECODE_GEMV", "1") != "0"}


@functools.cache
def kernels() -> SimpleNamespace | None:
    """The fused kernels (rmsnorm, apply_rope_qk_, silu_mul, gemv, qkv_rope_store), or None
    where Triton is missing."""
    try:
        from pdserve.kernels.fused_norm import rmsnorm
        from pdserve.kernels.gemv import gemv, qkv_rope_store
        from pdserve.kernels.rope import apply_rope_qk_
        from pdserve.kernels.silu_mul import silu_mul
    except ImportError:
        return None
    return SimpleNamespace(rmsnorm=rmsnorm, apply_rope_qk_=apply_rope_qk_, silu_mul=silu_mul,
                           gemv=gemv, qkv_rope_store=qkv_rope_store)


def use_fused(x: torch.Tensor) -> bool:
    return _enabled["ops"] and x.is_cuda and kernels() is not None


def use_decode_gemv(x: torch.Tensor) -> bool:
    return _enabled["gemv"] and use_fused(x)


@contextmanager
def _override(name: str, enabled: bool) -> Iterator[None]:
    saved, _enabled[name] = _enabled[name], enabled
    try:
        yield
    finally:
        _enabled[name] = saved


def fused_ops(enabled: bool) -> AbstractContextManager[None]:
    """All fused kernels on or off (off: the plain-torch reference)."""
    return _override("ops", enabled)


def decode_gemv(enabled: bool) -> AbstractContextManager[None]:
    """The batch-1 fused GEMV decode path on or off (off: cuBLAS and the separate kernels)."""
    return _override("gemv", enabled)
