"""RMSNorm and fused residual-add + RMSNorm in one pass over each row.

The unfused torch version reads and writes the hidden states about seven times per norm (cast,
square, mean, rsqrt, multiply, cast, weight multiply) plus twice for the residual add: on the
GPU that is a dozen small launches per norm in decode and tens of GB of traffic per prefill.
Rounding follows the reference (engine/models/layers.py, HF's order): the residual sum is
rounded to the activation dtype, normalised in fp32, cast back, then multiplied by the weight.
One program normalises one row of `hidden` elements (BLOCK >= hidden, a power of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or with `residual`: (norm(x + residual), x + residual)."""
    s = x if residual is None else x + residual
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(s.dtype)
    return out if residual is None else (out, s)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n
    h = (h * (1.0 / tl.sqrt(var + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = h.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton `rmsnorm_reference`. With `residual`, it is updated in place to x + residual
    and returned with the normalised sum (the next layer's residual stream)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x: expected [rows, hidden] with a contiguous last dim, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    rows, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"weight: expected ({n},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual: expected {tuple(x.shape)} {x.dtype}, contiguous last dim")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows:
        block = triton.next_power_of_2(n)
        res = residual if residual is not None else x
        _rmsnorm_kernel[(rows,)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
            HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, residual)
