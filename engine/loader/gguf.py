"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors dequantized to HF layout.

llama.cpp's converter permutes the rows of Q and K projections of `llama`-architecture models
so its interleaved RoPE matches HF's half-split one; we undo it (as transformers'
modeling_gguf_pytorch_utils does) so one model definition serves both sources.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.loader.common import (
    ModelLoadError,
    Slice,
    TensorSource,
    fill_weights,
    narrow,
)
from pdserve.engine.loader.gguf_file import GGUFFile, GGUFTensor
from pdserve.engine.loader.hf import check_architecture
from pdserve.engine.models import LlamaForCausalLM
from pdserve.engine.tp.group import TPGroup

# GGUF `general.architecture` -> HF architecture (Mistral GGUFs declare `llama`).
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Architectures whose Q/K rows llama.cpp permuted for its interleaved RoPE.
_PERMUTED = ("llama",)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _open(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"{path}: cannot read GGUF ({e})") from e


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF name, or None for tensors the model does not take directly."""
    head, _, suffix = gguf_name.rpartition(".")
    if head in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[head]}.{suffix}"
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _config(reader: GGUFFile, path: str) -> tuple[ModelConfig, str]:
    gguf_arch = str(_field(reader, "general.architecture", ""))
    arch = _ARCHITECTURES.get(gguf_arch, f"gguf:{gguf_arch}")
    check_architecture(arch, path)
    tensors = {t.name: t for t in reader.tensors}
    a = gguf_arch

    def need(key: str) -> Any:
        v = _field(reader, f"{a}.{key}")
        if v is None:
            raise ModelLoadError(f"{path}: missing metadata {a}.{key!r}")
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = _field(reader, f"{a}.vocab_size")
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[0]) if "token_embd.weight" in tensors \
            else len(need("tokenizer.ggml.tokens"))
    rope_scaling: dict[str, Any] | None = None
    if "rope_freqs.weight" in tensors:  # Llama 3.1: final per-frequency divisors, precomputed
        factors = _dequantize(tensors["rope_freqs.weight"]).flatten().tolist()
        rope_scaling = {"rope_type": "freq_factors", "factors": factors}
    elif _field(reader, f"{a}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear",
                        "factor": float(_field(reader, f"{a}.rope.scaling.factor"))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    head_dim = (_field(reader, f"{a}.attention.key_length")
                or _field(reader, f"{a}.rope.dimension_count") or hidden // heads)
    try:
        config = ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(_field(reader, f"{a}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(int(i) for i in dict.fromkeys((eos, eot)) if i is not None),
            name=os.path.basename(path).removesuffix(".gguf"),
        )
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return config, gguf_arch


def _dequantize(t: GGUFTensor) -> np.ndarray:
    from gguf.quants import dequantize

    arr = np.ascontiguousarray(dequantize(t.data, t.tensor_type))
    if not arr.flags.writeable:  # unquantized tensors come back as read-only views of the file
        arr = arr.copy()
    return arr.reshape(t.shape)


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows (pairs interleaved) -> (two halves)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _sources(reader: GGUFFile, path: str, config: ModelConfig, gguf_arch: str
             ) -> Iterator[TensorSource]:
    permute = gguf_arch in _PERMUTED
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        heads = (config.num_heads if ".q_proj." in name else
                 config.num_kv_heads if ".k_proj." in name else 0)
        yield path, name, _GGUFTensor(t, path, heads if permute else 0)


class _GGUFTensor:
    """A tensor of the mapped file. A slice of rows dequantizes only those rows (quantization
    blocks run along a row); a slice of columns dequantizes the whole tensor first."""

    def __init__(self, t: GGUFTensor, path: str, unpermute_heads: int) -> None:
        self.t, self.path, self.unpermute_heads = t, path, unpermute_heads
        self.shape = t.shape

    def read(self, part: Slice | None = None) -> torch.Tensor:
        t = self.t
        rows_only = part is not None and part[0] == 0 and len(t.shape) == 2
        data = t.data[part[1]:part[1] + part[2]] if rows_only else t.data
        shape = (part[2], *t.shape[1:]) if rows_only else t.shape
        try:
            w = torch.from_numpy(_dequantize(GGUFTensor(t.name, shape, t.tensor_type, data)))
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: cannot dequantize tensor {t.name!r} "
                                 f"({t.tensor_type.name}): {e}") from e
        # llama.cpp permuted rows within each head: whole heads unpermute on their own.
        heads = self.unpermute_heads * w.shape[0] // t.shape[0]
        if heads and w.shape[0] % (2 * heads) == 0:
            w = _unpermute(w, heads)
        return w if rows_only else narrow(w, part)


def read_gguf_config(path: str) -> ModelConfig:
    return _config(_open(path), path)[0]


def load_gguf_model(
    path: str, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None
) -> tuple[LlamaForCausalLM, ModelConfig]:
    reader = _open(path)
    config, gguf_arch = _config(reader, path)
    model = LlamaForCausalLM(config, dtype=dtype, device=device, tp=tp)
    fill_weights(model, _sources(reader, path, config, gguf_arch), path,
                 desc=f"Loading {config.name}")
    return model.eval(), config
