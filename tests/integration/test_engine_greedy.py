"""The offline engine on SmolLM2 equals HF transformers' greedy generate token for token.

Covers single prompts, a batch of mixed lengths (continuous batching), chunked prefill forced
small, prefix-cache hits (the same prefix twice) and retraction under KV pressure; afterwards
no KV page is held by a request. The default engine runs the CPU fast paths (packed decode
linears, the C++ decode attention); one test runs the plain-torch path against HF too.
"""

from __future__ import annotations

import pytest
from fixtures.hf_ref import hf_greedy, hf_model

from pdserve.engine.attention import cpu_decode
from pdserve.engine.cpu_linear import PackedLinearWeight
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Here is a list of fruits: apple, banana,",
    "In 1969, the first humans landed on the Moon. The name of the spacecraft",
    "Translate to French: good morning",
    "1, 2, 3, 4, 5,",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _ids(path: str, prompt: str) -> list[int]:
    return hf_model(path)[1].encode(prompt)


def _assert_idle(llm: LLM) -> None:
    st = llm.memory.stats()
    assert st.kv_pages_in_use == 0, st
    assert st.kv_pages_free + st.kv_pages_cached == st.kv_pages_total, st


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(model=smollm2_path, device="cpu", num_pages=512, max_running=16)


def test_single_prompts_equal_hf(llm, smollm2_path):
    for prompt in PROMPTS[:3]:
        ids = _ids(smollm2_path, prompt)
        out = llm.generate([ids], GREEDY)[0]
        assert out.token_ids == hf_greedy(smollm2_path, ids, 12), prompt
    _assert_idle(llm)


def test_mixed_batch_equals_hf(llm, smollm2_path):
    batch = [_ids(smollm2_path, p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0) for i in range(len(batch))]
    outs = llm.generate(batch, params)
    for ids, sp, out in zip(batch, params, outs):
        assert out.token_ids == hf_greedy(smollm2_path, ids, sp.max_tokens)
    _assert_idle(llm)


def test_small_chunked_prefill_equals_hf(smollm2_path):
    small = LLM(model=smollm2_path, device="cpu", num_pages=256, chunked_prefill_size=5,
                page_size=4)
    ids = _ids(smollm2_path, PROMPTS[2])
    assert small.generate([ids], GREEDY)[0].token_ids == hf_greedy(smollm2_path, ids, 12)
    _assert_idle(small)


def test_prefix_cache_hit_equals_hf(llm, smollm2_path):
    prefix = "You are a helpful assistant. Answer with one word. " * 4
    a = _ids(smollm2_path, prefix + "The sky is")
    b = _ids(smollm2_path, prefix + "Grass is")
    first = llm.generate([a], GREEDY)[0]
    second = llm.generate([b], GREEDY)[0]
    again = llm.generate([a], GREEDY)[0]
    assert second.cached_tokens >= 32 and again.cached_tokens >= 32
    assert first.token_ids == again.token_ids == hf_greedy(smollm2_path, a, 12)
    assert second.token_ids == hf_greedy(smollm2_path, b, 12)
    _assert_idle(llm)


def test_retraction_keeps_greedy_output(smollm2_path):
    # 8 requests of ~20 prompt + 24 output tokens need far more than 24 pages of 4 tokens:
    # decode runs out of KV, retracts, and recomputes later without losing tokens.
    tight = LLM(model=smollm2_path, device="cpu", num_pages=40, page_size=4, max_running=8)
    batch = [_ids(smollm2_path, p) for p in PROMPTS + PROMPTS[:3]]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = tight.generate(batch, sp)
    assert sum(o.num_retractions for o in outs) > 0, "the pool was meant to run short"
    for ids, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(smollm2_path, ids, 24, stop_at_eos=False)
    _assert_idle(tight)


def test_cpu_fast_paths_are_used(llm, smollm2_path):
    runner = llm.scheduler.runner
    assert isinstance(runner.model.layers[0].mlp.gate_up_proj, PackedLinearWeight)
    assert runner.attn_backend.cpu_kernel
    if cpu_decode.load(block=True) is None:
        pytest.skip("the C++ decode kernel could not be built here")
    ids = _ids(smollm2_path, PROMPTS[1])
    assert llm.generate([ids], GREEDY)[0].token_ids == hf_greedy(smollm2_path, ids, 12)
    assert runner.attn_backend._paged is not None  # the last forward, a decode, used the kernel
    assert runner.model.layers[0].mlp.gate_up_proj.packed is not None


def test_plain_torch_path_equals_hf(smollm2_path):
    plain = LLM(model=smollm2_path, device="cpu", num_pages=256, max_running=8, cpu_kernels=False)
    runner = plain.scheduler.runner
    assert not isinstance(runner.model.layers[0].mlp.gate_up_proj, PackedLinearWeight)
    assert not runner.attn_backend.cpu_kernel
    batch = [_ids(smollm2_path, p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0) for i in range(len(batch))]
    for ids, sp, out in zip(batch, params, plain.generate(batch, params)):
        assert out.token_ids == hf_greedy(smollm2_path, ids, sp.max_tokens)
    _assert_idle(plain)
