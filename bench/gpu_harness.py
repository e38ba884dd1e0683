"""Random-weight Llama models and paged batches for the GPU tests and `bench/gpu_bench.py`.

`PagedSeqs` keeps sequences in a KV pool on shuffled, non-contiguous pages (page 0 never used)
and builds ForwardBatch objects for extend and decode passes; `step_fn` picks how a batch runs
(eager backend, or a CUDA-graph runner for decode).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.config import ModelConfig
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.loader import shape_config
from pdserve.engine.models.llama import LlamaForCausalLM


def llama3_8b_config(num_layers: int = 32) -> ModelConfig:
    """The llama3-8b model shape (engine/model_shapes.py), without stop ids."""
    return dataclasses.replace(shape_config("llama3-8b"), num_layers=num_layers,
                               bos_token_id=None, eos_token_ids=(), name="llama3-8b-shape")


def small_config(num_layers: int = 2, heads: int = 8, kv_heads: int = 2) -> ModelConfig:
    """head_dim 128 and GQA group 4 as in Llama-3-8B, so FlashInfer JIT modules are shared."""
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=heads * 128,
                       intermediate_size=2048, num_layers=num_layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=128, max_position_embeddings=4096)


@torch.no_grad()
def random_model(cfg: ModelConfig, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> LlamaForCausalLM:
    """Weights N(0, 0.02), norms 1; matmul weights row-major (`set_weight_layout` changes it)."""
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # norm weights
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class PagedSeqs:
    """Sequences 0..B-1 in `pool`; `lens[i]` tokens of sequence i have KV (or are pretended to)."""

    def __init__(self, pool: KVPool, backend: AttentionBackend, seed: int = 0) -> None:
        self.pool = pool
        self.backend = backend
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(pool.num_pages - 1, generator=gen) + 1).tolist()
        self.pages: list[list[int]] = []
        self.lens: list[int] = []

    def reset(self, num_seqs: int) -> None:
        for p in self.pages:
            self.free.extend(p)
        self.pages = [[] for _ in range(num_seqs)]
        self.lens = [0] * num_seqs

    def _slots(self, i: int, start: int, end: int) -> torch.Tensor:
        ps = self.pool.page_size
        while len(self.pages[i]) * ps < end:
            if not self.free:
                raise ValueError("num_pages: KV pool too small for this test")
            self.pages[i].append(self.free.pop())
        pos = torch.arange(start, end)
        return torch.tensor(self.pages[i], dtype=torch.int64)[pos // ps] * ps + pos % ps

    def batch(self, new: list[list[int]], mode: ForwardMode | None = None) -> ForwardBatch:
        """A pass appending `new[i]` to sequence i (all sequences, in order); lens advance."""
        prefix = list(self.lens)
        ext = [len(t) for t in new]
        total = [p + e for p, e in zip(prefix, ext)]
        kv = [self._slots(i, 0, t) for i, t in enumerate(total)]
        dev = self.pool.device
        if mode is None:
            mode = ForwardMode.DECODE if all(e == 1 for e in ext) else ForwardMode.EXTEND

        def t(values) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.int64).to(dev, non_blocking=True)

        fb = ForwardBatch(
            mode=mode, input_ids=t([x for toks in new for x in toks]),
            positions=t(torch.cat([torch.arange(p, q) for p, q in zip(prefix, total)])),
            out_cache_loc=t(torch.cat([s[p:] for s, p in zip(kv, prefix)])),
            seq_lens=t(total), prefix_lens=t(prefix), extend_lens=t(ext),
            kv_indptr=t([0, *torch.cumsum(torch.tensor(total), 0).tolist()]),
            kv_indices=t(torch.cat(kv)), kv_pool=self.pool, attn_backend=self.backend,
            seq_lens_cpu=total, extend_lens_cpu=ext)
        self.lens = total
        return fb

    def pretend_context(self, num_seqs: int, context_len: int | list[int]) -> None:
        """Gives each sequence `context_len` tokens (or sequence i `context_len[i]`) of
        (garbage) KV without running them."""
        lens = [context_len] * num_seqs if isinstance(context_len, int) else list(context_len)
        self.reset(num_seqs)
        for i in range(num_seqs):
            self._slots(i, 0, lens[i])
        self.lens = lens


def eager_step(model: torch.nn.Module) -> Callable[[ForwardBatch], torch.Tensor]:
    def run(fb: ForwardBatch) -> torch.Tensor:
        fb.attn_backend.init_forward(fb)
        return model(fb)

    return run


def decode_step(model: torch.nn.Module, pool: KVPool, backend: AttentionBackend,
                graph_max_bs: int | None = None) -> Callable[[ForwardBatch], torch.Tensor]:
    """A decode step for `greedy_run`: eager, or replays of CUDA graphs captured for batches up
    to `graph_max_bs`."""
    if graph_max_bs is None:
        return eager_step(model)
    from pdserve.engine.cuda_graph import CudaGraphDecodeRunner

    runner = CudaGraphDecodeRunner(model, pool, backend, graph_max_bs)
    runner.capture()
    return runner.replay


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def greedy_run(model: torch.nn.Module, seqs: PagedSeqs, prompts: list[list[int]], steps: int,
               step: Callable[[ForwardBatch], torch.Tensor],
               forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill `prompts`, then `steps` greedy decode steps (or feed `forced[i]` tokens instead,
    teacher forcing). Returns tokens per sequence and the logits of every pass."""
    seqs.reset(len(prompts))
    fb = seqs.batch(prompts)
    fb.attn_backend.init_forward(fb)
    logits = [model(fb).float()]
    toks = [[int(x)] for x in logits[-1].argmax(-1).tolist()]
    for s in range(steps):
        feed = [f[s] for f in forced] if forced is not None else [t[-1] for t in toks]
        logits.append(step(seqs.batch([[x] for x in feed])).float().clone())
        for t, x in zip(toks, logits[-1].argmax(-1).tolist()):
            t.append(int(x))
    return toks, logits


def confident_agreement(ref_logits: list[torch.Tensor], logits: list[torch.Tensor],
                        margin: float) -> tuple[int, int]:
    """(agreeing, counted) argmaxes over positions where the reference's top-2 gap > margin:
    a gap below the numerical noise of bf16 is a tie, and either answer is right."""
    agree = counted = 0
    for r, x in zip(ref_logits, logits):
        top = r.topk(2, dim=-1).values
        sure = (top[:, 0] - top[:, 1]) > margin
        counted += int(sure.sum())
        agree += int(((r.argmax(-1) == x.argmax(-1)) & sure).sum())
    return agree, counted
