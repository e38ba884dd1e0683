"""Rotary position embeddings with the scaling variants Llama-family checkpoints use.

Layout is the Hugging Face one (rotate_half over two contiguous halves of head_dim). GGUF files
from llama.cpp store Q/K rows interleaved for their RoPE; the GGUF loader un-permutes them so
this single layout serves both sources.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    # HF configs spell it `rope_type` (current) or `type` (older checkpoints).
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 after applying `rope_scaling`."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta**exponent)
    kind = rope_type_of(rope_scaling)
    if kind == "default":
        return inv_freq
    cfg = rope_scaling or {}
    if kind == "linear":
        # Position interpolation: positions are divided by `factor`, i.e. frequencies are.
        return inv_freq / float(cfg["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, cfg)
    if kind == "freq_factors":
        # llama.cpp stores the final per-frequency divisors (`rope_freqs.weight`) in GGUF files.
        factors = torch.tensor(cfg["factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(
                f"rope_scaling: {factors.numel()} freq factors for head_dim {head_dim}")
        return inv_freq / factors
    raise ValueError(f"rope_scaling: unsupported rope type {kind!r} "
                     f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short kept, the band between blended."""
    factor = float(cfg["factor"])
    low_freq_factor = float(cfg.get("low_freq_factor", 1.0))
    high_freq_factor = float(cfg.get("high_freq_factor", 4.0))
    old_ctx = float(cfg.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_ctx / low_freq_factor
    high_freq_wavelen = old_ctx / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for arbitrary positions on the fly (no max-length table to size)."""

    def __init__(
        self, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)
        # A buffer so `.to(device)` moves it; not persistent, it is never a checkpoint weight.
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._inv_freq_fp32 = inv_freq

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # `model.to(bfloat16)` would round the frequencies; RoPE angles need fp32 (HF does the
        # same computation in fp32), so restore them and keep only the device change.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [T] -> (cos, sin) each [T, 1, head_dim], computed in fp32, cast to dtype."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


    def cos_sin_half(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> fp32 (cos, sin) each [T, head_dim // 2], for kernels/rope.py."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by per-token cos/sin [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
