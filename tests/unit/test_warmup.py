"""Warm-up runs every path of a worker's first requests once and leaves nothing behind."""

from __future__ import annotations

import pytest

from pdserve.engine.attention import cpu_decode
from pdserve.engine.cpu_linear import PackedLinearWeight
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.warmup import WARMUP_PATHS, warm_up

PROMPTS = [[11, 12, 13, 14, 15], list(range(100, 140))]


@pytest.fixture(scope="module")
def outputs_cold() -> list[list[int]]:
    llm = LLM(model_shape="tiny", device="cpu")
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6,
                                                                      temperature=0))]


def test_warm_up_runs_each_path_and_leaves_the_engine_as_new(outputs_cold) -> None:
    llm = LLM(model_shape="tiny", device="cpu")
    packed = [p for p in llm.scheduler.runner.model.parameters()
              if isinstance(p, PackedLinearWeight)]
    assert packed and all(p.packed is None for p in packed)  # packing is lazy
    logged: list[str] = []
    report = warm_up(llm.scheduler, log=logged.append)
    cpu_paths = ["weight_packing", "cpu_decode_kernel", "prefill", "prefill_cached_prefix",
                 "decode", "decode_overlap"]
    assert list(report) == cpu_paths and set(report) <= set(WARMUP_PATHS)
    assert all(t > 0 for t in report.values()) and len(logged) == len(cpu_paths)
    assert all(p.packed is not None for p in packed)
    assert cpu_decode.load(block=False) is not None
    stats = llm.memory.stats()
    assert stats.kv_pages_free == stats.kv_pages_total and stats.kv_pages_cached == 0
    assert llm.memory.req_to_token.num_used == 0
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    assert [o.token_ids for o in outs] == outputs_cold
    assert [o.cached_tokens for o in outs] == [0, 0]  # the warm-up cached nothing


def test_extend_batches_cover_the_sizes_within_the_budget_and_the_pool() -> None:
    from pdserve.engine.warmup import EXTEND_SIZES, extend_batches

    got = extend_batches(2048, 256, 1 << 20)
    sums = [sum(b) for b in got]
    assert sums == sorted({*EXTEND_SIZES, 2047, 2048})
    assert all(0 < n <= 256 for b in got for n in b)
    # at most half the pool
    assert [sum(b) for b in extend_batches(2048, 256, 2000)] == [256, 512, 513, 777, 1000]
    assert [sum(b) for b in extend_batches(600, 100, 1 << 20)] == [256, 512, 513, 599, 600]
