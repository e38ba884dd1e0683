"""Which of the model's fused kernel paths run: `Fusion`, one per model, shared by its layers.

- ops: the elementwise ops as Triton kernels (kernels/fused_norm.py, rope.py, silu_mul.py);
  off, plain torch: the reference the GPU tests and benchmarks compare against. Every other
  switch needs this one.
- decode_gemv: a one-token decode step through the fused matrix-vector kernels
  (kernels/gemv.py, engine/models/decode_gemv.py).
- gemm_silu: the MLP's gate_up projection of SILU_MIN_ROWS or more rows through our GEMM with
  SiLU-mul in its epilogue (kernels/gemm.py; bf16 / fp16, row-major weight, Hopper or later for
  TMA) instead of cuBLAS followed by the SiLU-mul kernel.
- rope_store: a decode step's RoPE and KV store as one kernel (kernels/rope.apply_rope_store_);
  off: RoPE, then the attention backend's store.
- residual_gemm: the projections that close a block (o_proj, down_proj) add into the residual
  stream inside their cuBLAS GEMM (`residual.addmm_`, beta = 1); off: the add is fused into
  the next RMSNorm, which then reads and writes the stream too.

The defaults come from the PDSERVE_* switches (pdserve/envs.py). Fused paths run on CUDA
tensors when Triton imports; `on_cpu` also runs them on CPU tensors (Triton's interpreter, for
tests). A CUDA graph keeps what was chosen when it was captured.

Why an object owned by the model rather than process-wide flags: the benchmarks and GPU tests
compare paths on one model with the same weights (`with model.fusion.override(ops=False):`),
which names the model it changes and cannot leak into another model in the process (the fp32
copy the benchmark builds takes its own `Fusion`). The layers hold the model's instance, so an
override on the model reaches all of them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from pdserve.envs import envs


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


@dataclasses.dataclass
class Fusion:
    """The fused paths one model may take (see the module docstring for each switch)."""

    ops: bool = True
    decode_gemv: bool = True
    gemm_silu: bool = True
    rope_store: bool = True
    residual_gemm: bool = True
    on_cpu: bool = False

    @classmethod
    def from_envs(cls) -> Fusion:
        e = envs()
        return cls(ops=e.fused_ops, decode_gemv=e.decode_gemv, gemm_silu=e.gemm_silu,
                   rope_store=e.rope_store, residual_gemm=e.residual_gemm)

    @contextmanager
    def override(self, **switches: bool) -> Iterator[None]:
        """Sets the named switches inside the block, restoring them after it."""
        names = [f.name for f in dataclasses.fields(self)]
        for name, value in switches.items():
            if name not in names:
                raise ValueError(f"{name}: not a Fusion switch (one of {', '.join(names)})")
            if not isinstance(value, bool):
                raise ValueError(f"{name}: must be a bool, got {value!r}")
        saved = {name: getattr(self, name) for name in switches}
        for name, value in switches.items():
            setattr(self, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def use_fused(self, x: torch.Tensor) -> bool:
        return self.ops and (x.is_cuda or self.on_cpu) and kernels() is not None

    def use_decode_gemv(self, x: torch.Tensor) -> bool:
        return self.decode_gemv and self.use_fused(x)

    def use_rope_store(self, x: torch.Tensor) -> bool:
        return self.rope_store and self.use_fused(x)

    def use_residual_gemm(self, x: torch.Tensor) -> bool:
        return self.residual_gemm and self.use_fused(x)

    def use_gemm_silu(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether gate_up(x) + SiLU-mul runs through kernels/gemm.py (x [T, K], w [2I, K];
        TMA wants 16-byte aligned rows)."""
        return (self.gemm_silu and self.use_fused(x) and x.dim() == 2
                and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
                and x.shape[0] >= kernels().silu_min_rows and kernels().gemm_supported(x.device)
                and x.stride(-1) == 1 and w.stride(-1) == 1
                and x.shape[1] % 8 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)
