"""Tensor-parallel shards: the layout of heads, KV heads, MLP columns and vocabulary per rank,
and sharded loading (each rank reads its slices of safetensors and GGUF tensors) against the
matching slices of the whole model. No processes: a rank's shard loads without its group."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fixtures.tiny_gguf import write_tiny_gguf
from fixtures.tiny_model import write_tiny_model

from pdserve.engine.config import ModelConfig
from pdserve.engine.loader import load_model
from pdserve.engine.models import LlamaForCausalLM
from pdserve.engine.tp.group import TPGroup, rank_device
from pdserve.engine.tp.layout import TPShard, check_tp

SMOLLM2 = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                      intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, name="smollm2")


def _cfg(**kw) -> ModelConfig:
    return dataclasses.replace(SMOLLM2, **kw)


def test_layout_splits_heads_and_replicates_kv_heads() -> None:
    shards = [TPShard.of(SMOLLM2, 3, r) for r in range(3)]
    assert [(s.head_start, s.num_heads) for s in shards] == [(0, 3), (3, 3), (6, 3)]
    assert [(s.kv_head_start, s.num_kv_heads, s.kv_replicas) for s in shards] == \
        [(0, 1, 1), (1, 1, 1), (2, 1, 1)]
    assert [(s.intermediate_start, s.intermediate_size) for s in shards] == \
        [(0, 512), (512, 512), (1024, 512)]
    # 8 KV heads over 4 ranks: 2 each; 2 KV heads over 4 ranks: each held by 2 ranks, and a
    # rank's query heads all read the KV head it holds (GQA groups do not straddle ranks).
    cfg = _cfg(num_heads=32, num_kv_heads=8, intermediate_size=128)
    assert [TPShard.of(cfg, 4, r).kv_head_start for r in range(4)] == [0, 2, 4, 6]
    cfg = _cfg(num_heads=8, num_kv_heads=2, intermediate_size=128)
    shards = [TPShard.of(cfg, 4, r) for r in range(4)]
    assert [(s.kv_head_start, s.num_kv_heads, s.kv_replicas) for s in shards] == \
        [(0, 1, 2), (0, 1, 2), (1, 1, 2), (1, 1, 2)]
    group = cfg.num_heads // cfg.num_kv_heads
    for s in shards:
        assert {h // group for h in range(s.head_start, s.head_start + s.num_heads)} == \
            {s.kv_head_start}


def test_layout_pads_the_vocabulary_to_equal_slices() -> None:
    cfg = _cfg(vocab_size=10, num_heads=4, num_kv_heads=4, intermediate_size=8)
    shards = [TPShard.of(cfg, 4, r) for r in range(4)]
    assert [(s.vocab_start, s.vocab_len, s.vocab_per_rank) for s in shards] == \
        [(0, 3, 3), (3, 3, 3), (6, 3, 3), (9, 1, 3)]
    one = TPShard.of(cfg)
    assert (one.num_heads, one.num_kv_heads, one.vocab_len) == (4, 4, 10)


@pytest.mark.parametrize(("changes", "size", "message"), [
    ({}, 2, "2 ranks do not divide num_heads 9"),
    ({"num_heads": 18, "num_kv_heads": 6, "intermediate_size": 1548}, 9,
     "9 ranks and num_kv_heads 6 .* one must divide the other"),
    ({"intermediate_size": 1537}, 3, "3 ranks do not divide intermediate_size 1537"),
    ({}, 0, "must be at least 1")])
def test_layout_refuses_splits_it_cannot_make(changes: dict, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"^tp: {message}"):
        check_tp(_cfg(**changes), size)
    check_tp(_cfg(num_kv_heads=3, intermediate_size=1548), 9)  # 3 KV heads over 9: replicated


def test_rank_devices() -> None:
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert rank_device("cuda", 1) == torch.device("cuda", 1)
    assert rank_device("cuda:2", 1) == torch.device("cuda", 3)


def _expected(full: LlamaForCausalLM, s: TPShard) -> dict[str, torch.Tensor]:
    """Rank `s`'s parameters cut from the whole model's."""
    cfg, d = full.config, full.config.head_dim

    def vocab(w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(s.vocab_per_rank, w.shape[1])
        out[:s.vocab_len] = w[s.vocab_start:s.vocab_start + s.vocab_len]
        return out

    def rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
        return w[start * d:(start + n) * d]

    want = {"embed_tokens": vocab(full.embed_tokens), "norm.weight": full.norm.weight}
    if not cfg.tie_word_embeddings:
        want["lm_head"] = vocab(full.lm_head)
    q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    i0, n = s.intermediate_start, s.intermediate_size
    for i, layer in enumerate(full.layers):
        a, m, pre = layer.self_attn, layer.mlp, f"layers.{i}."
        parts = [rows(a.qkv_proj, s.head_start, s.num_heads),
                 rows(a.qkv_proj[q:], s.kv_head_start, s.num_kv_heads),
                 rows(a.qkv_proj[q + kv:], s.kv_head_start, s.num_kv_heads)]
        want[pre + "self_attn.qkv_proj"] = torch.cat(parts)
        if a.qkv_bias is not None:
            b = a.qkv_bias[:, None]
            want[pre + "self_attn.qkv_bias"] = torch.cat([
                rows(b, s.head_start, s.num_heads), rows(b[q:], s.kv_head_start, s.num_kv_heads),
                rows(b[q + kv:], s.kv_head_start, s.num_kv_heads)])[:, 0]
        want[pre + "self_attn.o_proj"] = a.o_proj[:, s.head_start * d:(s.head_start +
                                                                        s.num_heads) * d]
        want[pre + "mlp.gate_up_proj"] = torch.cat([m.gate_up_proj[i0:i0 + n],
                                                    m.gate_up_proj[inter + i0:inter + i0 + n]])
        want[pre + "mlp.down_proj"] = m.down_proj[:, i0:i0 + n]
        want[pre + "input_layernorm.weight"] = layer.input_layernorm.weight
        want[pre + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return want


@pytest.mark.parametrize(("arch", "fmt", "size"), [
    ("llama", "safetensors", 2), ("llama", "safetensors", 4), ("qwen2", "safetensors", 2),
    ("mistral", "gguf", 2), ("llama", "gguf-q8", 4)])
def test_sharded_load_reads_each_ranks_slices(tmp_path, arch: str, fmt: str, size: int) -> None:
    """Each rank's shard equals the whole model's weights cut per TPShard (vocabulary 387:
    padded slices; mistral: one KV head, replicated; llama at 4: two KV heads, replicated)."""
    path = write_tiny_model(tmp_path / arch, arch, seed=3, vocab_size=387,
                            num_shards=2 if fmt == "safetensors" else 1)
    if fmt.startswith("gguf"):
        path = write_tiny_gguf(path, str(tmp_path / f"{arch}.gguf"),
                               arch="llama" if arch == "mistral" else arch,
                               quantize_q8=fmt == "gguf-q8")
    full, cfg = load_model(path, "float32", "cpu")
    for rank in range(size):
        shard_model, _ = load_model(path, "float32", "cpu", tp=TPGroup(rank, size))
        want = _expected(full, shard_model.shard)
        got = dict(shard_model.named_parameters())
        assert set(got) == set(want)
        for name, w in want.items():
            assert torch.equal(got[name], w), (rank, name)
        # Whole tensors handed to load_weights are cut the same way (benchmarks, tests).
        again = LlamaForCausalLM(cfg, tp=TPGroup(rank, size))
        again.load_weights((n, _hf_tensor(full, n)) for n in again.weight_shapes())
        for name, p in again.named_parameters():
            assert torch.equal(p, got[name]), (rank, name)


def _hf_tensor(full: LlamaForCausalLM, name: str) -> torch.Tensor:
    """The checkpoint tensor `name` rebuilt from the whole model's fused parameters."""
    t = full._targets()[name]
    return t.param[t.lo:t.hi]
