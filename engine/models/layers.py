"""Building blocks of a Llama-family decoder: RMSNorm and the fused SwiGLU MLP.

Parameters are allocated uninitialised (`torch.empty`): every one is overwritten by the loader,
and random init of a multi-billion-parameter model would cost seconds to minutes on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.models.fused import Fusion, kernels
from pdserve.engine.tp.group import TPGroup


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def set_weight_layout(weights: Iterable[nn.Parameter], column_major: bool) -> None:
    """Re-stores each [N, K] weight column-major (same shape and values, strides (1, N)) or
    back row-major, one matrix at a time. Column-major, F.linear multiplies by a row-major
    [K, N] matrix. Measured on an H200 (docs/performance.md), summed over a Llama-3-8B layer's
    matmuls: with cuBLASLt, column-major is 1.01x faster at batch 1 and 1.02x at batch 64, but
    at 4096 rows (prefill) cuBLAS runs the row-major layout 1.12x faster. Loading still works
    afterwards (row slices of a column-major weight are strided views; a test loads into one).
    Not for a weight that is also an embedding table (row gathers would become strided)."""
    for w in weights:
        if w.dim() != 2:
            continue
        if column_major and w.stride(0) != 1:
            w.data = w.data.t().contiguous().t()
        elif not column_major and not w.is_contiguous():
            w.data = w.data.contiguous()


class RMSNorm(nn.Module):
    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None,
        fusion: Fusion,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.fusion = fusion
        self.weight = empty_param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual): the add that closes a
        block fused with the norm that opens the next (in place on `residual` when fused)."""
        if self.fusion.use_fused(x):
            return kernels().rmsnorm(x, self.weight, self.eps, residual)
        s = x if residual is None else x + residual
        # Normalise in fp32 and cast back before the weight multiply: the order HF uses, so
        # bf16 results round the same way as the reference implementation.
        h = s.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(s.dtype)
        return out if residual is None else (out, s)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up in one [2 * intermediate, hidden] matmul.
    Under tensor parallelism `intermediate_size` is this rank's columns: gate/up are split by
    rows (column-parallel), down by columns (row-parallel, one all-reduce)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
        device: torch.device | str | None, fusion: Fusion, tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.fusion = fusion
        self.tp = tp if tp is not None else TPGroup()
        self.gate_up_proj = empty_param(2 * intermediate_size, hidden_size, dtype=dtype,
                                        device=device)
        self.down_proj = empty_param(hidden_size, intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output; with `residual`, added into it in place by the down projection's
        GEMM (and `residual` returned)."""
        if self.fusion.use_gemm_silu(x, self.gate_up_proj):
            act = kernels().gemm(x, self.gate_up_proj, silu_mul=True)
        else:
            gate_up = F.linear(x, self.gate_up_proj)
            if self.fusion.use_fused(gate_up):
                act = kernels().silu_mul(gate_up)
            else:
                gate, up = gate_up.split(self.intermediate_size, dim=-1)
                act = F.silu(gate) * up
        return row_parallel(act, self.down_proj, residual, self.tp)


def linear_into(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T, or with `residual` that product added into `residual` in place by the GEMM
    (one rounding) and `residual` returned."""
    return F.linear(x, w) if residual is None else residual.addmm_(x, w.t())


def row_parallel(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None,
                 tp: TPGroup) -> torch.Tensor:
    """linear_into over a weight split by input columns: each rank's partial product, summed
    by one all-reduce. With `residual`, rank 0 adds its partial into the residual and the
    others overwrite theirs with the partial (beta = 0), so the sum holds the residual once
    and every rank ends with the same stream."""
    if not tp.active:
        return linear_into(x, w, residual)
    if residual is None:
        return tp.all_reduce_(F.linear(x, w))
    residual.addmm_(x, w.t(), beta=1 if tp.rank == 0 else 0)
    return tp.all_reduce_(residual)
