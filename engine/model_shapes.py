"""Named model shapes: the config.json of well-known checkpoints, without their weights.

One table serves `--model-shape NAME` (a model with random weights, `--load-format dummy`, and
the embedded SmolLM2 tokenizer) and `pdserve kvbench --model-shape NAME` (KV pools of the
shape's layers, KV heads and head size). Entries are Hugging Face config.json dicts, so a shape
reads exactly like a downloaded checkpoint's config; this module imports neither torch nor
transformers (the router reads vocab sizes from it).

`tiny` is not a published model: two narrow layers with SmolLM2's vocabulary, for CPU tests and
for serving benchmarks whose engine must be much faster than the serving path around it.
"""

from __future__ import annotations

import argparse
from typing import Any

# Tokens of the embedded SmolLM2 tokenizer, which every shape is served with.
TOKENIZER_VOCAB = 49152

# name: (architecture, vocab, hidden, intermediate, layers, heads, kv heads, head_dim, rope theta,
#        rms eps, max positions, tied embeddings)
_ROWS: dict[str, tuple] = {
    "llama3-8b": ("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 500000.0, 1e-5,
                  8192, False),
    "llama3-70b": ("LlamaForCausalLM", 128256, 8192, 28672, 80, 64, 8, 128, 500000.0, 1e-5,
                   8192, False),
    "qwen2.5-7b": ("Qwen2ForCausalLM", 152064, 3584, 18944, 28, 28, 4, 128, 1000000.0, 1e-6,
                   32768, False),
    "smollm2-135m": ("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 100000.0, 1e-5,
                     8192, True),
    "smollm2-360m": ("LlamaForCausalLM", 49152, 960, 2560, 32, 15, 5, 64, 100000.0, 1e-5,
                     8192, True),
    "smollm2-1.7b": ("LlamaForCausalLM", 49152, 2048, 8192, 24, 32, 32, 64, 130000.0, 1e-5,
                     8192, True),
    "tiny": ("LlamaForCausalLM", 49152, 128, 256, 2, 4, 2, 32, 10000.0, 1e-5, 4096, True),
}
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def _config_json(row: tuple) -> dict[str, Any]:
    """A row as config.json. Every shape carries the special ids of SmolLM2's tokenizer, the
    one it is served with."""
    arch, vocab, hidden, inter, layers, heads, kv_heads, head_dim, theta, eps, max_pos, tied = row
    return {"architectures": [arch], "model_type": _MODEL_TYPES[arch], "hidden_act": "silu",
            "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "rope_theta": theta,
            "rms_norm_eps": eps, "max_position_embeddings": max_pos,
            "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2}


# How a model's weights are made: auto reads the checkpoint (HF safetensors or GGUF); dummy
# reads only its config (or takes a shape's) and draws random weights (engine/loader/dummy.py).
LOAD_FORMATS = ("auto", "dummy")
DEFAULT_LOAD_FORMAT = "auto"


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: unknown {load_format!r} (choose from "
                         f"{', '.join(LOAD_FORMATS)})")


def add_model_source_args(p: argparse.ArgumentParser) -> None:
    """`--model-shape` and `--load-format`, alike for every command that builds a model."""
    p.add_argument("--model-shape", default=None, choices=shape_names(),
                   help="a named shape with random weights and the embedded SmolLM2 "
                        "tokenizer, instead of --model")
    p.add_argument("--load-format", default=DEFAULT_LOAD_FORMAT, choices=LOAD_FORMATS,
                   help="auto: read the checkpoint; dummy: only its config, random weights")


def shape_names() -> list[str]:
    return sorted(_ROWS)


def hf_config(name: str) -> dict[str, Any]:
    """The config.json dict of shape `name` (a copy); ValueError naming model_shape if unknown."""
    if name not in _ROWS:
        raise ValueError(f"model_shape: unknown {name!r} (choose from {', '.join(shape_names())})")
    return _config_json(_ROWS[name])


def kv_shape(name: str) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of shape `name`: what a KV pool page holds."""
    cfg = hf_config(name)
    return cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]


def vocab_size(name: str) -> int:
    return int(hf_config(name)["vocab_size"])
