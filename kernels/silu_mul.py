"""SwiGLU activation: silu(gate) * up from the fused gate/up projection, in one pass.

The torch version launches three kernels and materialises silu(gate) in between; here each
element of `gate_up` [T, 2I] is read once and `out` [T, I] written once, in fp32 with one
rounding to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Triton `silu_mul_reference`: gate_up [T, 2I] -> [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up: expected [T, 2I] with a contiguous last dim, got "
                         f"{tuple(gate_up.shape)}")
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(t, n)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out
