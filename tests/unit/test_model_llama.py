"""Our Llama-family decoder through the paged KV pool vs HF transformers on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.paged import PagedRunner
from fixtures.tiny_model import TINY_ARCHS, write_tiny_model
from transformers import AutoModelForCausalLM

from pdserve.engine.loader import load_model

ATOL = 1e-4  # fp32; observed max differences are ~1e-5
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 120, 64, 33], [301, 12, 45, 6],
           [77, 300, 2, 19, 9, 10, 11]]


@pytest.fixture(scope="module", params=[*TINY_ARCHS, "llama-tied", "qwen2-untied"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, _, tie = request.param.partition("-")
    tie_flag = {"tied": True, "untied": False}.get(tie)
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=1,
                            tie_word_embeddings=tie_flag)
    ours, cfg = load_model(path, torch.float32, "cpu")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, theirs, cfg, path


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(hf_logits(hf, ids + out)[-1].argmax()))
    return out


def test_extend_then_decode_matches_hf(models) -> None:
    ours, hf, _, _ = models
    runner = PagedRunner(ours, page_size=4)
    prompt = PROMPTS[0]
    tokens = hf_greedy(hf, prompt, 6)
    ref = hf_logits(hf, prompt + tokens)
    got = [runner.extend({0: prompt})[0]]
    for tok in tokens[:-1]:
        got.append(runner.decode({0: tok})[0])
    for i, logits in enumerate(got):
        torch.testing.assert_close(logits, ref[len(prompt) - 1 + i], atol=ATOL, rtol=0)
    assert PagedRunner(ours).greedy(0, prompt, 6) == tokens


def test_extend_on_cached_prefix_matches_hf(models) -> None:
    ours, hf, _, _ = models
    runner = PagedRunner(ours, page_size=4)
    prompt = PROMPTS[0]
    runner.extend({1: prompt[:5]})  # ends mid-page: the second extend appends into that page
    got = runner.extend({1: prompt[5:]})[0]
    torch.testing.assert_close(got, hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)


def test_mixed_batches_match_hf(models) -> None:
    """Several sequences of different lengths, some with cached prefixes, then batched decode."""
    ours, hf, _, _ = models
    runner = PagedRunner(ours, page_size=4)
    runner.extend({2: PROMPTS[2][:3]})
    logits = runner.extend({0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[2][3:]})
    for row, prompt in zip(logits, PROMPTS):
        torch.testing.assert_close(row, hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)
    nxt = {0: 4, 1: 200, 2: 31}
    logits = runner.decode(nxt)
    for row, (seq, tok) in zip(logits, nxt.items()):
        torch.testing.assert_close(row, hf_logits(hf, PROMPTS[seq] + [tok])[-1], atol=ATOL, rtol=0)


def test_bf16_close_to_fp32(models) -> None:
    ours, _, _, path = models
    prompt = PROMPTS[0]
    ref = PagedRunner(ours).extend({0: prompt})[0]
    ours_bf16, _ = load_model(path, torch.bfloat16, "cpu")
    assert ours_bf16.rotary.inv_freq.dtype == torch.float32
    got = PagedRunner(ours_bf16).extend({0: prompt})[0]
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert got.argmax() == ref.argmax()


def test_to_dtype_keeps_rope_in_fp32(tiny_model_dir: str) -> None:
    model, _ = load_model(tiny_model_dir, torch.float32, "cpu")
    before = model.rotary.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.embed_tokens.dtype == torch.bfloat16
    assert torch.equal(model.rotary.inv_freq, before)


def test_rope_scaling_changes_outputs(tmp_path) -> None:
    """Guards against a silently ignored rope_scaling (both sides agreeing by accident)."""
    scaled, _ = load_model(write_tiny_model(tmp_path / "a", "llama3"), torch.float32, "cpu")
    plain_dir = write_tiny_model(tmp_path / "b", "llama3")
    cfg_path = plain_dir + "/config.json"
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("rope_scaling")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    plain, _ = load_model(plain_dir, torch.float32, "cpu")
    prompt = list(range(10, 40))
    a = PagedRunner(scaled).extend({0: prompt})[0]
    b = PagedRunner(plain).extend({0: prompt})[0]
    assert (a - b).abs().max() > 1e-2


def test_weights_load_into_column_major_layout(models) -> None:
    """A decode worker's layout (engine/models/layers.py): weights re-stored column-major keep
    their values, and checkpoint rows load into them as into row-major ones."""
    from pdserve.engine.models.layers import set_weight_layout
    from pdserve.engine.models.llama import LlamaForCausalLM

    ours, theirs, cfg, _ = models
    fresh = LlamaForCausalLM(cfg, dtype=torch.float32, device="cpu")
    set_weight_layout(fresh.projection_weights(), column_major=True)
    assert all(w.stride(0) == 1 for w in fresh.projection_weights())
    names = fresh.weight_shapes()
    fresh.load_weights((n, t) for n, t in theirs.state_dict().items() if n in names)
    for a, b in zip(fresh.projection_weights(), ours.projection_weights()):
        assert torch.equal(a, b)
    set_weight_layout(fresh.projection_weights(), column_major=False)
    assert all(w.is_contiguous() for w in fresh.projection_weights())
