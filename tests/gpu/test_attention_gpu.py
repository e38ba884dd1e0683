"""GPU attention: Triton kernels in bf16 at Llama-3 head shapes, the triton / flashinfer backends
against the torch reference on a small random model, and CUDA-graph decode against eager.

`PDSERVE_SKIP_FLASHINFER=1` skips the FlashInfer cases (its first prefill JIT takes ~75 s).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.gpu_harness import (
    PagedSeqs,
    confident_agreement,
    decode_step,
    eager_step,
    greedy_run,
    random_model,
    rel_diff,
    small_config,
)
from pdserve.bench.periodic_model import (
    continuation,
    greedy_cases,
    periodic_config,
    periodic_hf_model,
    periodic_model,
)
from pdserve.engine.kv_pool import KVPool
from pdserve.envs import envs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
# flashinfer-decode: the flashinfer backend with FlashInfer's BatchDecode for every decode
# batch (by default its smallest and largest decode batches run our Triton kernels);
# triton-worklist: the triton backend told its GPU has one SM, so that every decode batch of
# 8 / num_kv_heads or more sequences takes the work-list kernel (on 132 SMs: 8 x 132).
BACKENDS = ["triton", "triton-worklist", "flashinfer", "flashinfer-decode"]


def _backend(name: str, num_heads: int):
    if name.startswith("flashinfer"):
        if envs().skip_flashinfer:
            pytest.skip("PDSERVE_SKIP_FLASHINFER set")
        pytest.importorskip("flashinfer")
    from pdserve.engine.model_runner import default_attention_backend

    backend = default_attention_backend(torch.device("cuda"), name.split("-")[0],
                                        num_heads=num_heads)
    if name == "flashinfer-decode":
        backend.flashinfer_decode_only = True
    if name == "triton-worklist":
        backend._num_sms = 1
    return backend


def _paged(seq_lens: list[int], page: int, num_pages: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    slots, used = [], 0
    for n in seq_lens:
        pages = perm[used:used + -(-n // page)]
        used += len(pages)
        pos = torch.arange(n)
        slots.append(torch.tensor(pages)[pos // page] * page + pos % page)
    indptr = torch.tensor([0, *torch.cumsum(torch.tensor(seq_lens), 0).tolist()])
    return indptr.cuda(), torch.cat(slots).cuda()


@pytest.mark.parametrize("seq_lens", [[1, 17, 300, 1024], [4096], [5] * 64,
                                      [1024] * 255 + [32768]])
def test_decode_kernel_bf16(seq_lens: list[int]) -> None:
    from pdserve.kernels.attention_reference import decode_attention_reference
    from pdserve.kernels.decode_attention import decode_attention, split_kv_config
    from pdserve.kernels.decode_worklist import decode_attention_worklist, decode_plan

    page, num_pages = 16, 1 + sum(-(-n // 16) for n in seq_lens) + 4
    pool = torch.randn(num_pages, 2, 2, page, 8, 128, device="cuda", dtype=torch.bfloat16)
    indptr, indices = _paged(seq_lens, page, num_pages, 0)
    q = torch.randn(len(seq_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    want = decode_attention_reference(q, kc, vc, indptr, indices, 128**-0.5)
    for splits, block_n in ((1, 64), split_kv_config(len(seq_lens), 8, 132), (32, 64),
                            (64, 32)):
        out = decode_attention(q, kc, vc, indptr, indices, 128**-0.5, num_splits=splits,
                               block_n=block_n)
        assert rel_diff(out, want) < 1e-2, (splits, block_n)
    b = len(seq_lens)
    for target, block_n in ((1, 64), (b + b // 16, 128), (300, 128)):
        plan = decode_plan(indptr, b, target, block_n)
        out = decode_attention_worklist(q, kc, vc, indptr, indices, 128**-0.5, plan)
        assert rel_diff(out, want) < 1e-2, (target, block_n)


def test_extend_kernel_bf16() -> None:
    from pdserve.kernels.attention_reference import extend_attention_reference
    from pdserve.kernels.extend_attention import extend_attention

    prefix, ext = [0, 100, 37, 512], [300, 1, 64, 129]
    seq_lens = [p + e for p, e in zip(prefix, ext)]
    page, num_pages = 16, 1 + sum(-(-n // 16) for n in seq_lens) + 4
    pool = torch.randn(num_pages, 1, 2, page, 8, 128, device="cuda", dtype=torch.bfloat16)
    kv_indptr, indices = _paged(seq_lens, page, num_pages, 1)
    qo = torch.tensor([0, *torch.cumsum(torch.tensor(ext), 0).tolist()]).cuda()
    q = torch.randn(sum(ext), 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    out = extend_attention(q, kc, vc, qo, kv_indptr, indices, 128**-0.5, max(ext))
    want = extend_attention_reference(q, kc, vc, qo, kv_indptr, indices, 128**-0.5)
    assert rel_diff(out, want) < 1e-2


def test_store_and_page_copy_on_gpu() -> None:
    from pdserve.kernels import page_copy, page_copy_triton
    from pdserve.kernels.kv_store import store_kv, store_kv_reference

    pool = torch.randn(64, 4, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    ref = pool.clone()
    slots = torch.randperm(63 * 16, device="cuda")[:100] + 16
    k, v = torch.randn(2, 100, 8, 128, device="cuda", dtype=torch.bfloat16)
    store_kv(pool[:, 2, 0], pool[:, 2, 1], slots, k, v)
    store_kv_reference(ref[:, 2, 0], ref[:, 2, 1], slots, k, v)
    assert torch.equal(pool, ref)
    pages = [5, 6, 7, 30, 2, 41]
    a = torch.empty(6, *pool.shape[1:], device="cuda", dtype=pool.dtype)
    b = torch.empty_like(a)
    page_copy_triton.gather_pages(pool, pages, a)
    page_copy.gather_pages(pool, pages, b)
    assert torch.equal(a, b)
    p2, r2 = pool.clone(), pool.clone()
    page_copy_triton.scatter_pages(a.flip(0), p2, pages)
    page_copy.scatter_pages(a.flip(0), r2, pages)
    assert torch.equal(p2, r2)


def _run(model, name: str, prompts, steps: int, forced=None, graph_max_bs: int | None = None,
         pages: int = 512):
    from pdserve.engine.attention.torch_backend import TorchAttentionBackend

    cfg = model.config
    backend = TorchAttentionBackend() if name == "torch" else _backend(name, cfg.num_heads)
    pool = KVPool(pages, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16,
                  "cuda")
    step = decode_step(model, pool, backend, graph_max_bs)
    return greedy_run(model, PagedSeqs(pool, backend, seed=3), prompts, steps, step, forced)


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 200, (n,), generator=gen).tolist()
    return [torch.randint(0, 1024, (m,), generator=gen).tolist() for m in lens]


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_torch_reference(name: str) -> None:
    model = random_model(small_config(), seed=1)
    prompts = _prompts(5, 0)
    ref_toks, ref_logits = _run(model, "torch", prompts, 16)
    _, logits = _run(model, name, prompts, 16, forced=[t[:-1] for t in ref_toks])
    worst = max(rel_diff(x, r) for x, r in zip(logits, ref_logits))
    assert worst < 2e-2, worst
    agree, counted = confident_agreement(ref_logits, logits, margin=0.05)
    assert counted > 0 and agree == counted, (agree, counted)


@pytest.fixture(scope="module")
def periodic():
    """(our model, HF's) with weights that continue periodic sequences (periodic_model.py)."""
    cfg = periodic_config()
    return periodic_model(cfg, "cuda"), periodic_hf_model(cfg, "cuda")


@pytest.mark.parametrize(("name", "graph"), [("torch", False)] + [
    (name, graph) for name in BACKENDS for graph in (False, True)])
def test_greedy_64_steps_on_periodic_model(periodic, name: str, graph: bool) -> None:
    """Free-running greedy decode for 64 steps at batch 1, 5 and 13 (contexts 20-2000, the
    CUDA-graph batches padded to buckets 1, 8 and 16): every token equals the torch reference's
    (eager) and the pattern's continuation."""
    model, _ = periodic
    for prompts in greedy_cases(model.config.vocab_size):
        toks, _ = _run(model, name, prompts, 64, graph_max_bs=16 if graph else None, pages=2048)
        for prompt, got in zip(prompts, toks):
            assert got == continuation(prompt, 65), (len(prompt), got, continuation(prompt, 65))


def test_periodic_model_matches_hf_generate(periodic) -> None:
    """HF transformers' greedy generate (the plain reference) continues the pattern too, and
    the last prompt token's logits match ours."""
    model, hf = periodic
    prompt = greedy_cases(model.config.vocab_size)[1][2]
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, max_new_tokens=64, do_sample=False,
                      attention_mask=torch.ones_like(ids))
    assert out[0, len(prompt):].tolist() == continuation(prompt, 64)
    _, logits = _run(model, "triton", [prompt], 0)
    with torch.no_grad():
        want = hf(ids).logits[0, -1:].float()
    assert rel_diff(logits[0], want) < 2e-2, rel_diff(logits[0], want)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("batch", [1, 3, 8, 13])
def test_cuda_graph_matches_eager(name: str, batch: int) -> None:
    model = random_model(small_config(), seed=2)
    prompts = _prompts(batch, batch)
    eager_toks, eager_logits = _run(model, name, prompts, 12)
    _, logits = _run(model, name, prompts, 12, forced=[t[:-1] for t in eager_toks],
                     graph_max_bs=16)
    worst = max(rel_diff(x, r) for x, r in zip(logits, eager_logits))
    assert worst < 1e-2, worst
    agree, counted = confident_agreement(eager_logits, logits, margin=0.05)
    assert agree == counted, (agree, counted)


@pytest.mark.parametrize("name", BACKENDS)
def test_chunked_prefill_over_cached_prefix(name: str) -> None:
    """Prompts prefilled in two chunks (the second over the first's cached KV: the paged path)
    and whole (FlashInfer's ragged path when no prefix is cached): both match the torch
    reference, logits of every chunk and of the decode steps after."""
    from pdserve.engine.attention.torch_backend import TorchAttentionBackend

    model = random_model(small_config(), seed=4)
    cfg = model.config
    prompts = _prompts(4, 7)
    cut = [max(1, len(p) // 3) for p in prompts]
    results = {}
    for which in ("torch", name):
        backend = TorchAttentionBackend() if which == "torch" else _backend(name, cfg.num_heads)
        pool = KVPool(256, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16,
                      "cuda")
        seqs = PagedSeqs(pool, backend, seed=5)
        seqs.reset(len(prompts))
        step = eager_step(model)
        logits = [step(seqs.batch([p[:c] for p, c in zip(prompts, cut)])).float(),
                  step(seqs.batch([p[c:] for p, c in zip(prompts, cut)])).float()]
        for _ in range(3):
            logits.append(step(seqs.batch([[5]] * len(prompts))).float())
        whole = PagedSeqs(pool, backend, seed=6)
        whole.reset(len(prompts))
        logits.append(step(whole.batch(prompts)).float())
        results[which] = logits
    for got, ref in zip(results[name], results["torch"]):
        assert rel_diff(got, ref) < 2e-2, rel_diff(got, ref)
    # The second chunk ends where the whole prompt ends: same last-token logits.
    assert rel_diff(results[name][1], results[name][-1]) < 2e-2


def test_column_major_weights_match_row_major() -> None:
    """A decode worker's layout (column-major matmul weights, cuBLASLt graphs) gives the logits
    of the row-major model, eager and through CUDA graphs."""
    from pdserve.engine.models.layers import set_weight_layout

    model = random_model(small_config(), seed=3)
    prompts = _prompts(3, 9)
    ref_toks, ref_logits = _run(model, "triton", prompts, 8)
    set_weight_layout(model.projection_weights(), column_major=True)
    assert model.layers[0].mlp.down_proj.stride(0) == 1
    forced = [t[:-1] for t in ref_toks]
    for graph in (None, 8):
        _, logits = _run(model, "triton", prompts, 8, forced=forced, graph_max_bs=graph)
        worst = max(rel_diff(x, r) for x, r in zip(logits, ref_logits))
        assert worst < 1e-2, (graph, worst)
    set_weight_layout(model.projection_weights(), column_major=False)
    assert model.layers[0].mlp.down_proj.is_contiguous()


@pytest.mark.parametrize("name", BACKENDS)
def test_batch1_gemv_decode_matches_reference(name: str) -> None:
    """One-token decode through the fused GEMV kernels (kernels/gemv.py) against the torch
    reference (torch attention, cuBLAS, separate kernels): 64 teacher-forced steps, eager and
    through CUDA graphs, row- and column-major weights; and the same backend unfused."""
    from pdserve.engine.models.layers import set_weight_layout

    model = random_model(small_config(), seed=6)
    prompts = _prompts(1, 11)
    with model.fusion.override(decode_gemv=False):
        ref_toks, ref_logits = _run(model, "torch", prompts, 64)
        forced = [t[:-1] for t in ref_toks]
        _, unfused = _run(model, name, prompts, 64, forced=forced)
    runs = {"unfused": unfused}
    for column_major in (False, True):
        set_weight_layout(model.projection_weights(), column_major=column_major)
        for graph in (None, 8):
            runs[column_major, graph] = _run(model, name, prompts, 64, forced=forced,
                                             graph_max_bs=graph)[1]
    set_weight_layout(model.projection_weights(), column_major=False)
    for key, logits in runs.items():
        worst = max(rel_diff(x, r) for x, r in zip(logits, ref_logits))
        assert worst < 2e-2, (key, worst)
        agree, counted = confident_agreement(ref_logits, logits, margin=0.05)
        assert counted > 32 and agree == counted, (key, agree, counted)
