"""Building blocks of a Llama-family decoder: RMSNorm and the fused SwiGLU MLP.

Parameters are allocated uninitialised (`torch.empty`): every one is overwritten by the loader,
and random init of a multi-billion-parameter model would cost seconds to minutes on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight multiply: the order HF uses, so
        # bf16 results round the same way as the reference implementation.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up in one [2 * intermediate, hidden] matmul."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = empty_param(2 * intermediate_size, hidden_size, dtype=dtype,
                                        device=device)
        self.down_proj = empty_param(hidden_size, intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)
