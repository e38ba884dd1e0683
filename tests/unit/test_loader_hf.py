"""HF-directory loading: config parsing, sharded checkpoints, and clear load errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from fixtures.paged import PagedRunner
from fixtures.tiny_model import write_tiny_model
from safetensors.torch import load_file, save_file

from pdserve.engine.loader import ModelLoadError, load_model, load_tokenizer, read_model_config


def _edit_config(path: str, **changes: object) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def test_config_fields(tiny_model_dir: str) -> None:
    cfg = read_model_config(tiny_model_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 2, 4, 2)
    assert cfg.head_dim == 16 and not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (2, 0)  # config.json's eos, then generation_config's extras
    assert cfg.name == os.path.basename(tiny_model_dir)


def test_rope_parameters_spelling(tmp_path) -> None:
    """Newer configs put rope_theta and the scaling type into one `rope_parameters` dict."""
    path = write_tiny_model(tmp_path / "m", "llama3")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    legacy = read_model_config(path)
    params = {**cfg.pop("rope_scaling"), "rope_theta": cfg.pop("rope_theta")}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "rope_parameters": params}, f)
    new = read_model_config(path)
    assert new.rope_theta == legacy.rope_theta == 500000.0
    assert new.rope_scaling == legacy.rope_scaling


def test_sharded_equals_single(tmp_path) -> None:
    single, _ = load_model(write_tiny_model(tmp_path / "one", "qwen2", seed=3), "float32", "cpu")
    sharded, _ = load_model(write_tiny_model(tmp_path / "three", "qwen2", seed=3, num_shards=3),
                            "float32", "cpu")
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def test_bf16_load(tiny_model_dir: str) -> None:
    model, _ = load_model(tiny_model_dir, "bf16", "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert PagedRunner(model).extend({0: [1, 2, 3]}).shape == (1, 384)


def test_tokenizer(tiny_model_dir: str) -> None:
    tok = load_tokenizer(tiny_model_dir)
    assert tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_unknown_architecture(tmp_path) -> None:
    path = write_tiny_model(tmp_path / "m")
    _edit_config(path, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        load_model(path, "float32", "cpu")


def test_missing_weight_file(tmp_path) -> None:
    path = write_tiny_model(tmp_path / "m", num_shards=2)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(path, "float32", "cpu")


def test_no_weights_at_all(tmp_path) -> None:
    path = write_tiny_model(tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(path, "float32", "cpu")


def test_missing_tensor(tmp_path) -> None:
    path = write_tiny_model(tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, file)
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(path, "float32", "cpu")


def test_misshaped_tensor(tmp_path) -> None:
    path = write_tiny_model(tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(weights, file)
    with pytest.raises(ModelLoadError) as err:
        load_model(path, "float32", "cpu")
    msg = str(err.value)
    assert "model.safetensors" in msg and "model.layers.0.self_attn.k_proj.weight" in msg
    assert "(64, 64)" in msg and "(32, 64)" in msg


def test_not_a_model(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no such"):
        load_model(str(tmp_path / "nope"), "float32", "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"), "float32", "cpu")
