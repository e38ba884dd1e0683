"""The periodic model (bench/periodic_model.py), which the GPU tests use for greedy
checks, does what it is built for on CPU: our engine's model and HF transformers both continue
its patterns, and their logits agree."""

from __future__ import annotations

import torch

from pdserve.bench.periodic_model import (
    continuation,
    greedy_cases,
    periodic_config,
    periodic_hf_model,
    periodic_model,
)


def _greedy(model, prompts: list[list[int]], steps: int) -> list[list[int]]:  # noqa: ANN001
    from pdserve.bench.gpu_harness import PagedSeqs, eager_step, greedy_run
    from pdserve.engine.attention.torch_backend import TorchAttentionBackend
    from pdserve.engine.kv_pool import KVPool

    cfg = model.config
    pool = KVPool(512, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    return greedy_run(model, PagedSeqs(pool, TorchAttentionBackend(), seed=1), prompts, steps,
                      eager_step(model))


def test_periodic_model_continues_patterns_like_hf() -> None:
    cfg = periodic_config()
    ours, hf = periodic_model(cfg, "cpu"), periodic_hf_model(cfg, "cpu")
    prompts = greedy_cases(cfg.vocab_size)[1][:4]  # contexts 37, 200, 555, 1030
    toks, logits = _greedy(ours, prompts, 24)
    assert toks == [continuation(p, 25) for p in prompts]
    top = logits[0].topk(2, dim=-1).values
    assert float((top[:, 0] - top[:, 1]).min()) > 8  # far ahead of bf16 noise
    ids = torch.tensor([prompts[1]])
    out = hf.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))
    assert out[0, ids.shape[1]:].tolist() == continuation(prompts[1], 24)
    with torch.no_grad():
        want = hf(ids).logits[0, -1].float()
    diff = (logits[0][1] - want).norm() / want.norm()
    assert diff < 1e-2, diff


def test_wrong_offset_breaks_the_pattern() -> None:
    """The check can fail: with RoPE positions one step off, attention lands on the wrong key."""
    cfg = periodic_config()
    hf = periodic_hf_model(cfg, "cpu")
    prompt = greedy_cases(cfg.vocab_size)[1][1]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        right = hf(ids).logits[0, -1].argmax()
        wrong = hf(ids, position_ids=torch.arange(len(prompt))[None] * 2).logits[0, -1].argmax()
    assert int(right) == continuation(prompt, 1)[0]
    assert int(wrong) != int(right)
