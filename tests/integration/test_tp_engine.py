"""Tensor parallelism on the CPU (gloo, real rank processes): TP=2 and TP=4 on a tiny random
Llama and TP=3 on SmolLM2 give the same greedy tokens as TP=1, and logits within 1e-4 at every
step (fp32), through the offline engine's scheduler (chunked prefill, a cached prefix, batched
decode). The tiny model's vocabulary (387) does not divide by 2 or 4: padded head slices."""

from __future__ import annotations

import pytest
import torch
from fixtures.tiny_model import write_tiny_model

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

ATOL = 1e-4
TINY_PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 120, 64, 33, 386, 12, 200, 7, 9, 1, 55, 300, 2],
                [301, 12, 45, 6], [77, 300, 2, 19, 9, 10, 11]]
SMOL_PROMPTS = ["The capital of France is", "def add(a, b):"]


def _generate(model: str, tp: int, prompts: list, max_tokens: int, **kw
              ) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
    """Greedy outputs, and each step's logits by request id. Prompts run in two calls: the
    second repeats the first prompt's prefix (a radix-cache hit)."""
    steps: list[dict[str, torch.Tensor]] = []
    with LLM(model, num_pages=96, page_size=4, tp=tp, **kw) as llm:
        runner = llm.scheduler.runner
        sample = runner.sample

        def recording(logits: torch.Tensor, reqs: list) -> object:
            steps.append({r.rid: logits[i].clone() for i, r in enumerate(reqs)})
            return sample(logits, reqs)

        runner.sample = recording
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, sp)
        again = prompts[0][:-2] + [7] if isinstance(prompts[0], list) else prompts[0] + " Rome"
        outs += llm.generate([again], sp)
        assert llm.scheduler.memory.stats().kv_pages_in_use == 0
    return [o.token_ids for o in outs], steps


def _assert_same(ref: tuple, got: tuple) -> None:
    (ref_ids, ref_steps), (ids, steps) = ref, got
    assert ids == ref_ids
    assert [sorted(s) for s in steps] == [sorted(s) for s in ref_steps]
    for a, b in zip(ref_steps, steps):
        for rid in a:
            torch.testing.assert_close(b[rid], a[rid], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def tiny_387(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny387"), "llama", seed=4,
                            vocab_size=387)


@pytest.fixture(scope="module")
def tiny_ref(tiny_387: str) -> tuple:
    return _generate(tiny_387, 1, TINY_PROMPTS, 6, chunked_prefill_size=8)


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_llama_tp_equals_tp1(tiny_387: str, tiny_ref: tuple, tp: int) -> None:
    _assert_same(tiny_ref, _generate(tiny_387, tp, TINY_PROMPTS, 6, chunked_prefill_size=8))


def test_smollm2_tp3_equals_tp1(smollm2_path: str) -> None:
    """SmolLM2-135M: 9 heads and 3 KV heads over 3 ranks (GGUF, sharded by rows)."""
    ref = _generate(smollm2_path, 1, SMOL_PROMPTS, 4)
    _assert_same(ref, _generate(smollm2_path, 3, SMOL_PROMPTS, 4))
