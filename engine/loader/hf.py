"""Hugging Face model directories: config.json -> ModelConfig, (sharded) *.safetensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.loader.common import ModelLoadError, Slice, TensorSource, fill_weights
from pdserve.engine.models import SUPPORTED_ARCHITECTURES, LlamaForCausalLM
from pdserve.engine.models.rope import SUPPORTED_ROPE_TYPES, rope_type_of
from pdserve.engine.tp.group import TPGroup

# Checkpoints without an `architectures` list still carry a model_type.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e


def check_architecture(arch: str, where: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{where}: unsupported architecture {arch!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for v in values:
        for i in (v if isinstance(v, list) else [v]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def read_hf_config(model_dir: str) -> ModelConfig:
    """config.json (+ generation_config.json for extra stop ids) -> ModelConfig."""
    path = os.path.join(model_dir, "config.json")
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(gen_path) if os.path.exists(gen_path) else {}
    return config_from_dict(_read_json(path), gen, path,
                            os.path.basename(os.path.normpath(model_dir)))


def config_from_dict(cfg: dict[str, Any], gen: dict[str, Any], path: str,
                     name: str) -> ModelConfig:
    """A config.json dict (and generation_config.json's) -> ModelConfig; errors name `path`."""
    archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "")]
    arch = archs[0] or f"model_type={cfg.get('model_type')!r}"
    check_architecture(arch, path)

    # Older checkpoints: rope_theta + rope_scaling; newer: one rope_parameters dict.
    rope_params = cfg.get("rope_parameters") or {}
    rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params else None)
    rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    kind = rope_type_of(rope_scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{path}: unsupported rope scaling {kind!r} "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if kind == "default":
        rope_scaling = None
    else:
        rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
        rope_scaling.setdefault("original_max_position_embeddings", max_pos)

    try:
        num_heads = int(cfg["num_attention_heads"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; its config does not say so.
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id"), gen.get("eos_token_id")),
            name=name,
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing field {e.args[0]!r}") from e
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}: {e}") from e


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [os.path.join(model_dir, n) for n in names]
        for f in files:
            if not os.path.exists(f):
                raise ModelLoadError(f"{f}: weight file listed in {index} does not exist")
        return files
    files = sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir)
                   if n.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files "
                             "(PyTorch .bin checkpoints are not supported)")
    return files


def _sources(files: list[str]) -> Iterator[TensorSource]:
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except (OSError, RuntimeError) as e:  # safetensors raises on truncated/corrupt headers
            raise ModelLoadError(f"{file}: cannot read safetensors ({e})") from e
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield file, name, _SafetensorsTensor(f, file, name)


class _SafetensorsTensor:
    """A tensor of an open safetensors file; a slice reads only its own bytes (get_slice)."""

    def __init__(self, f: Any, file: str, name: str) -> None:
        self.f, self.file, self.name = f, file, name
        try:
            self.slicer = f.get_slice(name)
            self.shape = tuple(self.slicer.get_shape())
        except (OSError, RuntimeError) as e:
            raise ModelLoadError(f"{file}: cannot read tensor {name!r} ({e})") from e

    def read(self, part: Slice | None = None) -> torch.Tensor:
        try:
            if part is None:
                return self.f.get_tensor(self.name)
            dim, start, length = part
            index = (slice(None),) * dim + (slice(start, start + length),)
            return self.slicer[index]
        except (OSError, RuntimeError) as e:
            raise ModelLoadError(f"{self.file}: cannot read tensor {self.name!r} ({e})") from e


def load_hf_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None
) -> tuple[LlamaForCausalLM, ModelConfig]:
    config = read_hf_config(model_dir)
    files = safetensors_files(model_dir)
    model = LlamaForCausalLM(config, dtype=dtype, device=device, tp=tp)
    fill_weights(model, _sources(files), model_dir, desc=f"Loading {config.name}")
    return model.eval(), config
