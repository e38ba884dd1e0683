"""GGUF loading: tiny converted models (fast, exact) and the embedded SmolLM2 Q4_1 file."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from fixtures.hf_ref import hf_model
from fixtures.paged import PagedRunner
from fixtures.tiny_gguf import write_tiny_gguf
from fixtures.tiny_model import write_tiny_model
from transformers import AutoModelForCausalLM

from pdserve.engine.loader import ModelLoadError, load_model, load_tokenizer, read_model_config

PROMPT = list(range(3, 20))


@torch.no_grad()
def _hf_gguf(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_gguf_equals_hf_directory(tmp_path, arch: str) -> None:
    """Unquantized GGUF (with llama.cpp's Q/K permutation) loads to exactly the HF weights."""
    hf_dir = write_tiny_model(tmp_path / arch, arch)
    gguf_arch = "llama" if arch == "mistral" else arch  # llama.cpp files Mistral as llama
    path = write_tiny_gguf(hf_dir, str(tmp_path / f"{arch}.gguf"), arch=gguf_arch)
    ours_hf, _ = load_model(hf_dir, "float32", "cpu")
    ours_gguf, cfg = load_model(path, "float32", "cpu")
    assert cfg.name == arch and cfg.head_dim == ours_hf.config.head_dim
    for (name, a), (_, b) in zip(ours_hf.named_parameters(), ours_gguf.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_q8_gguf_matches_transformers(tmp_path, arch: str) -> None:
    hf_dir = write_tiny_model(tmp_path / arch, arch, seed=2)
    path = write_tiny_gguf(hf_dir, str(tmp_path / "q8.gguf"), quantize_q8=True)
    ours, _ = load_model(path, "float32", "cpu")
    with torch.no_grad():
        ref = _hf_gguf(path)(torch.tensor([PROMPT])).logits[0, -1]
    got = PagedRunner(ours).extend({0: PROMPT})[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_unsupported_gguf_architecture(tmp_path) -> None:
    import gguf

    path = str(tmp_path / "gpt2.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="gpt2.*LlamaForCausalLM"):
        load_model(path, "float32", "cpu")


def test_gguf_missing_tensor(tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    hf_dir = write_tiny_model(tmp_path / "m", "llama")
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, os.path.join(hf_dir, "model.safetensors"))
    path = write_tiny_gguf(hf_dir, str(tmp_path / "broken.gguf"))
    with pytest.raises(ModelLoadError, match="broken.gguf.*model.layers.1.mlp.down_proj"):
        load_model(path, "float32", "cpu")


# ---- the embedded default model ----


@pytest.fixture(scope="module")
def smollm2(smollm2_path: str):
    model, cfg = load_model(smollm2_path, "float32", "cpu")
    return model, cfg, load_tokenizer(smollm2_path)


def test_smollm2_config(smollm2_path: str) -> None:
    cfg = read_model_config(smollm2_path)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and 2 in cfg.eos_token_ids
    assert cfg.name == "SmolLM2-135M-Instruct.Q4_1"


def test_smollm2_greedy_paris(smollm2) -> None:
    model, _, tok = smollm2
    ids = tok("The capital of France is").input_ids
    out = PagedRunner(model, page_size=16, max_seq_len=64).greedy(0, ids, 6)
    assert "Paris" in tok.decode(out)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_load(smollm2, smollm2_path: str) -> None:
    """Our dequantization + Q/K un-permutation agree with transformers' own GGUF loader."""
    model, _, tok = smollm2
    ids = tok("The capital of France is").input_ids
    runner = PagedRunner(model, page_size=16, max_seq_len=64)
    got = [runner.extend({0: ids})[0]]
    tokens = [int(got[0].argmax())]
    for _ in range(4):
        got.append(runner.decode({0: tokens[-1]})[0])
        tokens.append(int(got[-1].argmax()))
    with torch.no_grad():
        # One transformers GGUF load per test session (it is slow), shared with other tests.
        ref = hf_model(smollm2_path)[0](torch.tensor([ids + tokens[:-1]])).logits[0]
    for i, logits in enumerate(got):
        torch.testing.assert_close(logits, ref[len(ids) - 1 + i], atol=1e-3, rtol=0)
    assert tokens == ref[len(ids) - 1:].argmax(-1).tolist()


def test_smollm2_tokenizer_cache_round_trip(smollm2, smollm2_path: str) -> None:
    """The cached HF-format copy of the GGUF tokenizer encodes and templates identically."""
    from pdserve.engine.default_model import cache_dir
    from pdserve.engine.loader.tokenizer import _cache_key

    _, _, tok = smollm2  # its load populated the cache
    assert os.path.isdir(os.path.join(cache_dir(), "tokenizers", _cache_key(smollm2_path)))
    again = load_tokenizer(smollm2_path)
    for text in ["The capital of France is", "café  日本語\n<|im_end|>", ""]:
        assert again(text).input_ids == tok(text).input_ids
    msgs = [{"role": "user", "content": "Hi"}]
    assert again.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(
        msgs, tokenize=False)
    assert (again.eos_token_id, again.bos_token_id) == (tok.eos_token_id, tok.bos_token_id)
