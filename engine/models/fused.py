"""Whether the model's elementwise ops run as fused Triton kernels (kernels/fused_norm.py,
rope.py, silu_mul.py) or as plain torch, whether a one-token decode step runs through the
fused matrix-vector kernels (kernels/gemv.py, engine/models/decode_gemv.py), and whether the
MLP's gate_up projection of SILU_MIN_ROWS or more rows runs through our GEMM with SiLU-mul in
its epilogue (kernels/gemm.py) instead of cuBLAS followed by the SiLU-mul kernel, and whether a
decode step's RoPE and KV store are one kernel (kernels/rope.apply_rope_store_;
PDSERVE_ROPE_STORE=0 or `rope_store(False)`: RoPE, then the backend's store), and whether the
projections that close a block (o_proj, down_proj) add into the residual stream inside their
cuBLAS GEMM (`residual.addmm_`, beta = 1; PDSERVE_RESIDUAL_GEMM=0 or `residual_gemm(False)`:
the add is fused into the next RMSNorm instead, which then reads and writes the stream too).

Fused on CUDA when Triton imports; plain torch on CPU, with PDSERVE_FUSED_OPS=0, or inside
`fused_ops(False)` (the torch reference the GPU tests compare against). The batch-1 GEMV path
additionally needs PDSERVE_DECODE_GEMV unset or 1 and no `decode_gemv(False)`; the GEMM
PDSERVE_GEMM_SILU unset or 1, no `gemm_silu(False)`, bf16 / fp16, a row-major weight and a
Hopper or later GPU (TMA). A CUDA graph keeps what was chosen when it was captured.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import SimpleNamespace

import torch

_enabled = {"ops": os.environ.get("PDSERVE_FUSED_OPS", "1") != "0",
            "gemv": os.environ.get("PDSERVE_DECODE_GEMV", "1") != "0",
            "gemm": os.environ.get("PDSERVE_GEMM_SILU", "1") != "0",
            "rope_store": os.environ.get("PDSERVE_ROPE_STORE", "1") != "0",
            "residual_gemm": os.environ.get("PDSERVE_RESIDUAL_GEMM", "1") != "0"}


@functools.cache
def kernels() -> SimpleNamespace | None:
    """The fused kernels (rmsnorm, apply_rope_qk_, apply_rope_store_, silu_mul, gemv,
    qkv_rope_store, gemm), or None where Triton is missing."""
    try:
        from pdserve.kernels.fused_norm import rmsnorm
        from pdserve.kernels.gemm import SILU_MIN_ROWS, gemm
        from pdserve.kernels.gemm import supported as gemm_supported
        from pdserve.kernels.gemv import gemv, qkv_rope_store
        from pdserve.kernels.rope import apply_rope_qk_, apply_rope_store_
        from pdserve.kernels.silu_mul import silu_mul
    except ImportError:
        return None
    return SimpleNamespace(rmsnorm=rmsnorm, apply_rope_qk_=apply_rope_qk_,
                           apply_rope_store_=apply_rope_store_, silu_mul=silu_mul,
                           gemv=gemv, qkv_rope_store=qkv_rope_store, gemm=gemm,
                           gemm_supported=gemm_supported, silu_min_rows=SILU_MIN_ROWS)


def use_fused(x: torch.Tensor) -> bool:
    return _enabled["ops"] and x.is_cuda and kernels() is not None


def use_decode_gemv(x: torch.Tensor) -> bool:
    return _enabled["gemv"] and use_fused(x)


def use_rope_store(x: torch.Tensor) -> bool:
    return _enabled["rope_store"] and use_fused(x)


def use_residual_gemm(x: torch.Tensor) -> bool:
    return _enabled["residual_gemm"] and use_fused(x)


def use_gemm_silu(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gate_up(x) + SiLU-mul runs through kernels/gemm.py (x [T, K], w [2I, K]; TMA
    wants 16-byte aligned rows)."""
    return (_enabled["gemm"] and use_fused(x) and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and x.shape[0] >= kernels().silu_min_rows and kernels().gemm_supported(x.device)
            and x.stride(-1) == 1 and w.stride(-1) == 1
            and x.shape[1] % 8 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


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


def gemm_silu(enabled: bool) -> AbstractContextManager[None]:
    """The MLP's GEMM with SiLU-mul in its epilogue on or off (off: cuBLAS + SiLU-mul kernel)."""
    return _override("gemm", enabled)


def rope_store(enabled: bool) -> AbstractContextManager[None]:
    """A decode step's RoPE + KV store as one kernel on or off."""
    return _override("rope_store", enabled)


def residual_gemm(enabled: bool) -> AbstractContextManager[None]:
    """The residual add inside the closing projections' GEMMs on or off (off: in the norms)."""
    return _override("residual_gemm", enabled)
