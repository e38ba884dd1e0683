"""Whether the model's elementwise ops run as fused Triton kernels (kernels/fused_norm.py,
rope.py, silu_mul.py) or as plain torch.

Fused on CUDA when Triton imports; plain torch on CPU, with PDSERVE_FUSED_OPS=0, or inside
`fused_ops(False)` (the torch reference the GPU tests compare against). A CUDA graph keeps what
was chosen when it was captured.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

_enabled = os.environ.get("PDSERVE_FUSED_OPS", "1") != "0"


@functools.cache
def kernels() -> SimpleNamespace | None:
    """The fused kernels (rmsnorm, apply_rope_qk_, silu_mul), or None where Triton is missing."""
    try:
        from pdserve.kernels.fused_norm import rmsnorm
        from pdserve.kernels.rope import apply_rope_qk_
        from pdserve.kernels.silu_mul import silu_mul
    except ImportError:
        return None
    return SimpleNamespace(rmsnorm=rmsnorm, apply_rope_qk_=apply_rope_qk_, silu_mul=silu_mul)


def use_fused(x: torch.Tensor) -> bool:
    return _enabled and x.is_cuda and kernels() is not None


@contextmanager
def fused_ops(enabled: bool) -> Iterator[None]:
    global _enabled
    saved, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = saved
