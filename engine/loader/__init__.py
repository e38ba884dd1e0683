"""Weight loading: `load_model(path, dtype, device)` for HF directories and GGUF files, or random
weights (`load_format="dummy"`) for a checkpoint's config or a named shape (engine/model_shapes)."""

from __future__ import annotations

import os
from typing import Any

import torch

from pdserve.engine.config import ModelConfig, parse_dtype
from pdserve.engine.loader.common import ModelLoadError
from pdserve.engine.model_shapes import LOAD_FORMATS, check_load_format
from pdserve.engine.models import LlamaForCausalLM
from pdserve.engine.tp.group import TPGroup

__all__ = ["LOAD_FORMATS", "ModelLoadError", "check_load_format", "load_model",
           "load_tokenizer", "read_model_config", "resolve_model_path", "shape_config"]


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


def shape_config(name: str) -> ModelConfig:
    """The ModelConfig of a named shape (engine/model_shapes.py); ValueError if unknown."""
    from pdserve.engine.loader.hf import config_from_dict
    from pdserve.engine.model_shapes import hf_config

    return config_from_dict(hf_config(name), {}, f"model shape {name}", name)


def read_model_config(path: str | None, model_shape: str | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint (or of `model_shape`) without loading its weights."""
    if model_shape is not None:
        return shape_config(model_shape)
    if path is None:
        raise ValueError("model: give a model path or a model shape")
    kind, where = resolve_model_path(path)
    if kind == "hf":
        from pdserve.engine.loader.hf import read_hf_config

        return read_hf_config(where)
    from pdserve.engine.loader.gguf import read_gguf_config

    return read_gguf_config(where)


def load_model(
    path: str | None, dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu", tp: TPGroup | None = None, load_format: str = "auto",
    model_shape: str | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Builds the model on `device` in `dtype` and fills it from an HF directory or GGUF file,
    or with random weights (`load_format="dummy"`, implied by `model_shape`): then only the
    config of `path` is read (an HF directory may hold just config.json and tokenizer files).
    With `tp`, this rank's shard only."""
    check_load_format(load_format)
    dtype, device = parse_dtype(dtype), torch.device(device)
    if load_format == "dummy" or model_shape is not None:
        from pdserve.engine.loader.dummy import load_dummy_model
        from pdserve.engine.model_shapes import TOKENIZER_VOCAB

        return load_dummy_model(read_model_config(path, model_shape), dtype, device, tp,
                                text_vocab=TOKENIZER_VOCAB if model_shape is not None else None)
    if path is None:
        raise ValueError("model: give a model path or a model shape")
    kind, where = resolve_model_path(path)
    if kind == "hf":
        from pdserve.engine.loader.hf import load_hf_model

        return load_hf_model(where, dtype, device, tp)
    from pdserve.engine.loader.gguf import load_gguf_model

    return load_gguf_model(where, dtype, device, tp)


def load_tokenizer(path: str) -> Any:
    """The transformers tokenizer (with chat template) of an HF directory (tokenizer files
    alone will do) or GGUF file."""
    from pdserve.engine.loader.tokenizer import load_gguf_tokenizer, load_hf_tokenizer
    from pdserve.engine.served_tokenizer import has_tokenizer_files

    if has_tokenizer_files(path):
        return load_hf_tokenizer(path)
    kind, where = resolve_model_path(path)
    return load_hf_tokenizer(where) if kind == "hf" else load_gguf_tokenizer(where)
