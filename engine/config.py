"""Frozen per-role configuration shared by prefill and decode workers.

Validation raises ValueError naming the offending field, never `assert`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` / `"bf16"` / torch dtype -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(name, name)
    if key not in _DTYPES:
        raise ValueError(f"dtype: unsupported {name!r} (choose from {sorted(_DTYPES)})")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in _DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"dtype: unsupported {dtype}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder."""

    architecture: str  # e.g. "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF dict, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"  # identity used in the transfer fingerprint and /v1/models

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"{f}: must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")


@dataclass(frozen=True)
class CacheConfig:
    """KV pool sizing. `num_pages` wins over `mem_fraction` when given."""

    page_size: int = 16
    num_pages: int | None = None
    mem_fraction: float = 0.5  # of free device memory (CUDA) or of a host budget (CPU)
    max_reqs: int = 256  # request slots in ReqToTokenPool
    max_context_len: int | None = None  # defaults to the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size: must be a positive power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages: must be positive, got {self.num_pages}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction: must be in (0, 1], got {self.mem_fraction}")
        if self.max_reqs <= 0:
            raise ValueError(f"max_reqs: must be positive, got {self.max_reqs}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits shared by the engine, prefill and decode schedulers."""

    max_running: int = 64
    chunked_prefill_size: int = 2048  # token budget of one extend batch
    decode_reserve_tokens: int = 32  # per running request, kept free for decode growth
    overlap_schedule: bool = True  # on CUDA: launch decode step N+1 before reading step N back
    # Decode workers stream a running request's tokens every this many of its tokens (the first
    # and the last at once): fewer, larger messages at the cost of burstier streams.
    stream_interval: int = 1
    # ... and every ceil(running / this) tokens, so that a decode step sends about this many
    # messages however many requests run: each message costs the worker's and the router's
    # event loops tens of microseconds, the same for one token as for ten, and past a few
    # thousand a second they fall behind the engine (docs/performance.md, "Serving path").
    stream_messages_per_step: int = 32

    def __post_init__(self) -> None:
        if self.max_running <= 0:
            raise ValueError(f"max_running: must be positive, got {self.max_running}")
        if self.stream_interval <= 0:
            raise ValueError(f"stream_interval: must be positive, got {self.stream_interval}")
        if self.stream_messages_per_step <= 0:
            raise ValueError("stream_messages_per_step: must be positive, got "
                             f"{self.stream_messages_per_step}")
        if self.chunked_prefill_size <= 0:
            raise ValueError(
                f"chunked_prefill_size: must be positive, got {self.chunked_prefill_size}")
