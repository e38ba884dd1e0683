"""Weight loading: `load_model(path, dtype, device)` for HF directories and GGUF files."""

from __future__ import annotations

import os
from typing import Any

import torch

from pdserve.engine.config import ModelConfig, parse_dtype
from pdserve.engine.loader.common import ModelLoadError
from pdserve.engine.models import LlamaForCausalLM
from pdserve.engine.tp.group import TPGroup

__all__ = ["ModelLoadError", "load_model", "load_tokenizer", "read_model_config",
           "resolve_model_path"]


def resolve_model_path(path: str) -> tuple[str, str]:
    """-> ("hf", directory) or ("gguf", file). A directory holding one .gguf counts as GGUF."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        raise ModelLoadError(f"{path}: not a model directory or .gguf file")
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path}: no such model directory or file")
    if os.path.exists(os.path.join(path, "config.json")):
        return "hf", path
    ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return "gguf", os.path.join(path, ggufs[0])
    what = f"{len(ggufs)} .gguf files" if ggufs else "no config.json and no .gguf file"
    raise ModelLoadError(f"{path}: {what}")


def read_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a checkpoint without loading its weights."""
    kind, where = resolve_model_path(path)
    if kind == "hf":
        from pdserve.engine.loader.hf import read_hf_config

        return read_hf_config(where)
    from pdserve.engine.loader.gguf import read_gguf_config

    return read_gguf_config(where)


def load_model(
    path: str, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
    tp: TPGroup | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Builds the model on `device` in `dtype` and fills it from an HF directory or GGUF file;
    with `tp`, this rank's shard only."""
    dtype, device = parse_dtype(dtype), torch.device(device)
    kind, where = resolve_model_path(path)
    if kind == "hf":
        from pdserve.engine.loader.hf import load_hf_model

        return load_hf_model(where, dtype, device, tp)
    from pdserve.engine.loader.gguf import load_gguf_model

    return load_gguf_model(where, dtype, device, tp)


def load_tokenizer(path: str) -> Any:
    """The transformers tokenizer (with chat template) of an HF directory or GGUF file."""
    from pdserve.engine.loader.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

    kind, where = resolve_model_path(path)
    return load_hf_tokenizer(where) if kind == "hf" else load_gguf_tokenizer(where)
