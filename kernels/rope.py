"""Rotary embedding applied to q and k in place, in one launch (one program per token); or, for
a decode step, q rotated in place and the rotated k with v stored straight into their slots of
the page-major KV pool (`apply_rope_store_`: one launch instead of RoPE then the KV store, and k
never written back).

q and k may be strided views of the fused qkv projection. cos/sin come in fp32 at half the head
dim ([T, head_dim // 2], Hugging Face's rotate-half layout repeats them over both halves) and
the rotation is done in fp32 with one rounding to the activation dtype; the plain-torch path
(engine/models/rope.py) rounds cos/sin and each product to bf16, so this is the more exact one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import pdl_enter, use_pdl


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D // 2] fp32 -> rotated x (new tensor, x's dtype)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _check_cos_sin(cos: torch.Tensor, sin: torch.Tensor, t: int, d: int) -> None:
    if cos.shape != (t, d // 2) or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos: expected ({t}, {d // 2}) like sin, got {tuple(cos.shape)}")
    if cos.dtype != torch.float32 or cos.stride(-1) != 1:
        raise ValueError("cos: expected fp32 with a contiguous last dim")


@triton.jit
def _rotate(base, stride_h, c, s, d, HEADS: tl.constexpr, HALF: tl.constexpr,
            BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    m = (h < HEADS) & (d[None, :] < HALF)
    p = base + h * stride_h + d[None, :]
    x1 = tl.load(p, mask=m).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m).to(tl.float32)
    dt = base.dtype.element_ty
    tl.store(p, (x1 * c - x2 * s).to(dt), mask=m)
    tl.store(p + HALF, (x2 * c + x1 * s).to(dt), mask=m)


@triton.jit
def _rotate_q(q_ptr, cos_ptr, sin_ptr, t, stride_qt, stride_qh, stride_ct, HQ: tl.constexpr,
              HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token t's cos / sin ([1, BLOCK_D]); rotates its q heads in place."""
    d = tl.arange(0, BLOCK_D)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=d < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_ct + d, mask=d < HALF, other=0.0)[None, :]
    _rotate(q_ptr + t * stride_qt, stride_qh, c, s, d, HQ, HALF, BLOCK_HQ)
    return d, c, s


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d, c, s = _rotate_q(q_ptr, cos_ptr, sin_ptr, t, stride_qt, stride_qh, stride_ct, HQ, HALF,
                        BLOCK_HQ, BLOCK_D)
    _rotate(k_ptr + t * stride_kt, stride_kh, c, s, d, HK, HALF, BLOCK_HK)


def apply_rope_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> None:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place by per-token cos/sin [T, D // 2] fp32."""
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"k: shape {tuple(k.shape)} does not pair with q {tuple(q.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q: head_dim must be the contiguous (last) dimension")
    _check_cos_sin(cos, sin, t, d)
    if t == 0:
        return
    hq, hk = q.shape[1], k.shape[1]
    _rope_kernel[(t,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HQ=hq, HK=hk, HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HK=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(d // 2),
        num_warps=4)


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
    stride_cp, stride_co, stride_ch,
    PAGE_SIZE: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    d, c, s = _rotate_q(q_ptr, cos_ptr, sin_ptr, t, stride_qt, stride_qh, stride_ct, HQ, HALF,
                        BLOCK_HQ, BLOCK_D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    h = tl.arange(0, BLOCK_HK)[:, None]
    m = (h < HK) & (d[None, :] < HALF)
    dst = page * stride_cp + (slot - page * PAGE_SIZE) * stride_co + h * stride_ch + d[None, :]
    kp = k_ptr + t * stride_kt + h * stride_kh + d[None, :]
    k1 = tl.load(kp, mask=m).to(tl.float32)
    k2 = tl.load(kp + HALF, mask=m).to(tl.float32)
    dt = kc_ptr.dtype.element_ty
    tl.store(kc_ptr + dst, (k1 * c - k2 * s).to(dt), mask=m)
    tl.store(kc_ptr + dst + HALF, (k2 * c + k1 * s).to(dt), mask=m)
    vp = v_ptr + t * stride_vt + h * stride_vh + d[None, :]
    tl.store(vc_ptr + dst, tl.load(vp, mask=m).to(dt), mask=m)
    tl.store(vc_ptr + dst + HALF, tl.load(vp + HALF, mask=m).to(dt), mask=m)


def apply_rope_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor) -> None:
    """Rotates q [T, Hq, D] in place; writes rotated k and v ([T, Hk, D]) at token `slots` [T]
    of the per-layer pool views k_cache / v_cache [P, page_size, Hk, D] (k is left as it was).
    The same as `apply_rope_qk_` followed by kernels/kv_store.store_kv."""
    t, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"k / v: shapes {tuple(k.shape)} / {tuple(v.shape)} do not pair with q "
                         f"{tuple(q.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q: head_dim must be the contiguous (last) dimension")
    _check_cos_sin(cos, sin, t, d)
    if (k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1
            or tuple(k_cache.shape[2:]) != (k.shape[1], d)):
        raise ValueError(f"k_cache: expected [P, page_size, {k.shape[1]}, {d}] views of one pool, "
                         f"got {tuple(k_cache.shape)}")
    if slots.shape != (t,):
        raise ValueError(f"slots: expected ({t},), got {tuple(slots.shape)}")
    if t == 0:
        return
    hq, hk = q.shape[1], k.shape[1]
    pdl = use_pdl(q.device)
    _rope_store_kernel[(t,)](
        q, k, v, cos, sin, k_cache, v_cache, slots, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), PAGE_SIZE=k_cache.shape[1], HQ=hq, HK=hk,
        HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_D=triton.next_power_of_2(d // 2), USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
