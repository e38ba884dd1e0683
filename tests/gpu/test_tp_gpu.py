"""The tensor-parallel code path on one GPU: a real NCCL group of one rank, its all-reduces,
vocab-parallel embedding and logits all-gather run in every forward pass, captured inside the
decode CUDA graphs; greedy tokens and logits equal the model without a group (TP=1). Batch 1
takes the fused GEMV path, larger batches the GEMM path; both eager and through graphs."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pdserve.bench.gpu_harness import (
    PagedSeqs,
    decode_step,
    greedy_run,
    random_model,
    rel_diff,
    small_config,
)
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.tp.group import TPGroup
from pdserve.envs import envs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def nccl_group() -> Iterator[TPGroup]:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    yield TPGroup.connect(store, 0, 1, torch.device("cuda"))
    del store


def _backend(name: str, num_heads: int):
    if name == "flashinfer":
        if envs().skip_flashinfer:
            pytest.skip("PDSERVE_SKIP_FLASHINFER set")
        pytest.importorskip("flashinfer")
    from pdserve.engine.model_runner import default_attention_backend

    return default_attention_backend(torch.device("cuda"), name, num_heads=num_heads)


def test_nccl_collectives_of_one_rank(nccl_group: TPGroup) -> None:
    x = torch.randn(3, 5, device="cuda")
    assert torch.equal(nccl_group.all_reduce_(x.clone()), x)
    assert torch.equal(nccl_group.all_gather_last(x), x)
    assert torch.equal(nccl_group.broadcast_(x.clone()), x)
    assert nccl_group.min_int(7) == 7


@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
@pytest.mark.parametrize("graphs", [False, True])
def test_group_of_one_equals_no_group(nccl_group: TPGroup, backend_name: str,
                                      graphs: bool) -> None:
    cfg = small_config()
    plain = random_model(cfg, seed=3)
    grouped = LlamaForCausalLM(cfg, dtype=torch.bfloat16, device="cuda", tp=nccl_group).eval()
    grouped.load_state_dict(plain.state_dict())
    prompts = [[5, 17, 99, 3, 250, 41, 7], [301, 12, 45, 6, 9], [77, 300, 2]]
    for batch in (prompts[:1], prompts):  # batch 1: fused GEMV decode; 3: GEMM decode
        runs = []
        for model in (plain, grouped):
            backend = _backend(backend_name, cfg.num_heads)
            pool = KVPool(64, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                          torch.bfloat16, "cuda")
            step = decode_step(model, pool, backend, 8 if graphs else None)
            runs.append(greedy_run(model, PagedSeqs(pool, backend), batch, 12, step))
        (ref_toks, ref_logits), (toks, logits) = runs
        assert toks == ref_toks
        for a, b in zip(ref_logits, logits):
            assert rel_diff(b, a) < 1e-3
