"""The whole engine on one GPU, through the tensor-parallel code path at TP=1: the offline LLM
(scheduler, packed host batches, runner, CUDA-graph decode, overlap scheduling) on the periodic
model saved as a Hugging Face checkpoint continues every prompt's pattern, for each attention
backend; the same model split over a real NCCL group of one rank (all-reduces, vocab-parallel
embedding, logits all-gather, captured in the graphs) gives the same tokens."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from fixtures.tiny_model import write_tokenizer

from pdserve.bench.periodic_model import (
    continuation,
    greedy_cases,
    periodic_config,
    periodic_hf_model,
)
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, build_runner
from pdserve.engine.llm import LLM
from pdserve.engine.memory import KVMemory
from pdserve.engine.req import Req
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tp.group import TPGroup
from pdserve.envs import envs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STEPS = 24


@pytest.fixture(scope="module")
def periodic_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("periodic")
    periodic_hf_model(periodic_config(), "cpu", torch.float32).save_pretrained(path)
    write_tokenizer(str(path))
    return str(path)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_llm_continues_every_pattern(periodic_dir: str, backend: str) -> None:
    if backend == "flashinfer" and envs().skip_flashinfer:
        pytest.skip("PDSERVE_SKIP_FLASHINFER set")
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    llm = LLM(periodic_dir, device="cuda", attention_backend=backend, num_pages=1024,
              max_running=16, tp=1)
    sp = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    assert llm.scheduler.runner.cuda_graph is not None
    assert llm.scheduler.overlap is not None
    for prompts in greedy_cases(periodic_config().vocab_size):
        outs = llm.generate(prompts, sp)
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == continuation(prompt, STEPS), len(prompt)
    assert llm.memory.stats().kv_pages_in_use == 0
    llm.close()


def test_runner_on_a_group_of_one_continues_every_pattern(periodic_dir: str) -> None:
    """build_runner with a real NCCL group of one rank, under the engine's scheduler: the
    runner's graphs hold the all-reduces and the logits all-gather; the greedy tokens still
    continue every pattern."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    group = TPGroup.connect(store, 0, 1, torch.device("cuda"))
    cfg = EngineConfig(model=periodic_dir, device="cuda", attention_backend="triton",
                       cache=CacheConfig(num_pages=1024, max_reqs=32),
                       scheduler=SchedulerConfig(max_running=16))
    runner = build_runner(cfg, group)
    assert runner.cuda_graph is not None and runner.model.tp.active
    sched = Scheduler(runner, KVMemory(runner.pool, 32, 4096), cfg.scheduler)
    sp = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    for prompts in greedy_cases(periodic_config().vocab_size):
        reqs = [Req(f"r{i}", p, sp) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.add(r)
        while sched.has_work:
            sched.step()
        for prompt, r in zip(prompts, reqs):
            assert r.output_ids == continuation(prompt, STEPS), len(prompt)
    del store
