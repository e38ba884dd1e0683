"""Model shapes (one table for `--model-shape` and kvbench) and random weights
(`--load-format dummy`): shapes, finite logits, determinism, clear errors."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from fixtures.paged import PagedRunner
from fixtures.tiny_model import tiny_config, write_tokenizer

from pdserve.bench.kv import MODEL_SHAPES
from pdserve.engine.engine import EngineConfig
from pdserve.engine.loader import ModelLoadError, load_model, read_model_config, shape_config
from pdserve.engine.loader.dummy import init_dummy_weights, load_dummy_model
from pdserve.engine.model_shapes import TOKENIZER_VOCAB, hf_config, kv_shape, shape_names
from pdserve.engine.models import LlamaForCausalLM
from pdserve.engine.served_tokenizer import FoldedVocab, fold_vocab

# Parameter counts of the published checkpoints (tied heads counted once).
PARAMS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
          "qwen2.5-7b": 7_615_616_512, "smollm2-135m": 134_515_008,
          "smollm2-360m": 361_821_120, "smollm2-1.7b": 1_711_376_384}


def _meta_model(name: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(shape_config(name), device="meta")


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_shape_builds_the_published_parameter_count(name: str) -> None:
    model = _meta_model(name)
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]
    cfg = shape_config(name)
    assert cfg.name == name and cfg.eos_token_ids == (2,)


def test_llama3_8b_layer_shapes() -> None:
    shapes = _meta_model("llama3-8b").weight_shapes()
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 4096)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)
    assert shapes["lm_head.weight"] == (128256, 4096)
    assert shape_config("qwen2.5-7b").attention_bias


def test_kvbench_uses_the_same_table() -> None:
    assert set(MODEL_SHAPES) == set(shape_names())
    for name in shape_names():
        cfg = hf_config(name)
        assert MODEL_SHAPES[name] == kv_shape(name) == (
            cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"])


def test_unknown_shape_and_format_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="model_shape: unknown 'llama9'"):
        shape_config("llama9")
    with pytest.raises(ValueError, match="model_shape"):
        EngineConfig(model_shape="llama9", device="cpu")
    with pytest.raises(ValueError, match="model_shape: give either"):
        EngineConfig(model="/x", model_shape="tiny", device="cpu")
    with pytest.raises(ValueError, match="load_format: unknown 'npz'"):
        EngineConfig(load_format="npz", device="cpu")


def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    return PagedRunner(model, max_seqs=1, max_seq_len=64).extend({0: ids})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_weights_give_finite_varied_logits_at_depth(dtype: torch.dtype) -> None:
    # The 70B shape's depth and GQA, narrow enough for a unit test.
    cfg = dataclasses.replace(shape_config("llama3-70b"), vocab_size=2048, hidden_size=256,
                              intermediate_size=512, num_heads=8, num_kv_heads=2,
                              head_dim=32)
    model = LlamaForCausalLM(cfg, dtype=dtype)
    init_dummy_weights(model)
    logits = _logits(model, list(range(1, 40)))
    assert torch.isfinite(logits).all()
    assert 0.3 < float(logits.std()) < 30.0  # neither collapsed nor blown up


def test_random_weights_are_seeded_and_tied_once() -> None:
    cfg = dataclasses.replace(shape_config("smollm2-135m"), num_layers=2)
    a = LlamaForCausalLM(cfg)
    b = LlamaForCausalLM(cfg)
    init_dummy_weights(a)
    init_dummy_weights(b)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a.lm_head is a.embed_tokens
    c = LlamaForCausalLM(cfg)
    init_dummy_weights(c, seed=1)
    assert not torch.equal(a.embed_tokens, c.embed_tokens)


def test_rows_past_the_tokenizer_are_zero_and_never_greedy() -> None:
    # The llama3-8b case (a head larger than the tokenizer), narrow: 3,000 rows, 1,200 shown.
    cfg = dataclasses.replace(shape_config("llama3-8b"), vocab_size=3000, hidden_size=256,
                              intermediate_size=512, num_layers=2, num_heads=8,
                              num_kv_heads=2, head_dim=32)
    model, _ = load_dummy_model(cfg, torch.float32, torch.device("cpu"), text_vocab=1200)
    assert not model.lm_head[:1200].eq(0).all(dim=1).any()  # every shown row is random
    assert model.lm_head[1200:].eq(0).all() and model.embed_tokens[1200:].eq(0).all()
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids = torch.randint(0, 1200, (30,), generator=gen).tolist()
        assert int(_logits(model, ids).argmax(dim=-1).max()) < 1200
    full, _ = load_dummy_model(cfg, torch.float32, torch.device("cpu"))  # no tokenizer limit
    assert torch.equal(full.lm_head[:1200], model.lm_head[:1200])
    assert not full.lm_head[1200:].eq(0).all(dim=1).any()


def test_shapes_are_loaded_with_the_tokenizer_size(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdserve.engine.loader.dummy as dummy

    assert hf_config("smollm2-135m")["vocab_size"] == TOKENIZER_VOCAB
    seen: list[tuple[int, int | None]] = []
    monkeypatch.setattr(dummy, "load_dummy_model", lambda cfg, *a, text_vocab=None, **k:
                        seen.append((cfg.vocab_size, text_vocab)))
    load_model(None, torch.float32, "cpu", model_shape="llama3-8b")
    assert seen == [(128256, TOKENIZER_VOCAB)]  # the full head: it costs the real model's


def test_smollm2_shape_loads_dummy_with_finite_logits() -> None:
    model, cfg = load_model(None, torch.float32, "cpu", model_shape="smollm2-135m")
    assert cfg.vocab_size == 49152 and len(model.layers) == 30
    assert torch.isfinite(_logits(model, [1, 2, 3, 4, 5])).all()


def _config_only_dir(root: str, cfg: dict) -> str:
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_tokenizer(root)
    return root


def test_config_only_directory_needs_dummy(tmp_path) -> None:
    path = _config_only_dir(str(tmp_path / "m"), tiny_config("qwen2"))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(path)
    model, cfg = load_model(path, load_format="dummy")
    assert cfg.attention_bias and torch.equal(model.layers[0].self_attn.qkv_bias,
                                              torch.zeros_like(model.layers[0].self_attn.qkv_bias))
    assert torch.isfinite(_logits(model, [3, 4, 5])).all()
    assert read_model_config(path) == cfg


def test_config_the_engine_cannot_build_names_the_field(tmp_path) -> None:
    bad = dict(tiny_config("llama"), num_key_value_heads=3)  # 4 heads: 3 does not divide
    path = _config_only_dir(str(tmp_path / "bad"), bad)
    with pytest.raises(ModelLoadError, match="num_kv_heads"):
        load_model(path, load_format="dummy")
    missing = {k: v for k, v in tiny_config("llama").items() if k != "num_attention_heads"}
    path = _config_only_dir(str(tmp_path / "missing"), missing)
    with pytest.raises(ModelLoadError, match="missing field 'num_attention_heads'"):
        load_model(path, load_format="dummy")


class _Tok:
    """A 10-token stand-in: id i decodes as chr(97 + i)."""

    eos_token_id = 2

    def __len__(self) -> int:
        return 10

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return "".join(chr(97 + i) for i in ids if 0 <= i < 10)


def test_folded_vocab_decodes_every_id() -> None:
    tok = fold_vocab(_Tok(), 25)
    assert isinstance(tok, FoldedVocab) and len(tok) == 25 and tok.eos_token_id == 2
    assert tok.decode([1, 12, 24]) == "bce"
    assert tok.decode(13) == "d"
    assert tok.decode([1, 12], skip_special_tokens=False) == "bc"
    plain = _Tok()
    assert fold_vocab(plain, 10) is plain and fold_vocab(plain, None) is plain
