"""Warm-up: run once, before a worker serves, every path that its first requests take.

Without it the first requests after start-up pay one-time costs inside their TTFT and ITL:
packing the fp32 weights for oneDNN (seconds on CPU, once per weight) and loading the C++
decode kernel, FlashInfer's and Triton's JIT compilation of the prefill and decode kernels on
CUDA (a minute on a fresh machine), first calls of every sampling stage. A worker therefore runs
`warm_up` on its own model and KV memory before it registers with a router, and `pdserve up`
prints `ready` only after every worker did.

The paths, each timed into the returned report (seconds; the tests check the names):
- `weight_packing` (CPU fp32): every oneDNN-packed weight packed, kernels of every row bucket
  built; `cpu_decode_kernel`: the C++ decode attention built or loaded from the cache;
- `cuda_graphs` (CUDA): the decode graphs, captured when the engine was built (their time);
- `prefill`: fresh prompts of several lengths in one extend batch (FlashInfer's ragged prefill);
- `prefill_cached_prefix`: a prompt whose prefix the radix cache holds (the paged prefill);
- `decode`: decode steps with greedy, seeded top-k/top-p, penalties and logprobs in one batch;
- `decode_overlap`: greedy decode steps alone (the overlapped loop on CUDA);
- `prefill_sizes` (CUDA): extend batches of the chunk budget's size, one token less, and sizes
  between, multiples of 16 and not. The Triton GEMMs compile a variant per row-count class
  (tile config, divisibility by 16, whether a GEMM's last wave is split: on an H200 the
  4096-wide projections split from 513 rows, the 6144-wide from 257), so 256 and 512 are
  classes of their own: served, the first lone 512-token extend took 850 ms (against 48 for
  2048 tokens) with 513 and 2048 warmed.
The warm-up requests' KV goes back and the radix cache is emptied: the worker starts with every
page free and nothing cached, as if it had never run.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from pdserve.engine.attention import cpu_decode
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.cpu_linear import PackedLinearWeight
from pdserve.engine.req import Req
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler

WARMUP_PATHS = ("weight_packing", "cpu_decode_kernel", "cuda_graphs", "prefill",
                "prefill_cached_prefix", "decode", "decode_overlap", "prefill_sizes")
EXTEND_SIZES = (256, 512, 513, 777, 1000, 1537)  # besides the chunk budget and one less


def extend_batches(chunk: int, max_len: int, free_tokens: int) -> list[list[int]]:
    """Prompt lengths per warm-up extend batch: each batch's lengths (each at most `max_len`)
    sum to one of the sizes `prefill_sizes` warms, all at most `chunk` and half the free KV."""
    cap = min(chunk, free_tokens // 2)
    sizes = sorted({n for n in (*EXTEND_SIZES, chunk - 1, chunk) if 1 < n <= cap})
    return [[max_len] * (n // max_len) + ([n % max_len] if n % max_len else []) for n in sizes]


def _pack_weights(model: torch.nn.Module) -> int:
    packed = {id(p): p for p in model.parameters() if isinstance(p, PackedLinearWeight)}
    for p in packed.values():
        p.pack()
    return len(packed)


class _Run:
    """Feeds warm-up requests through a plain engine Scheduler on the worker's runner and memory."""

    def __init__(self, scheduler: Scheduler, vocab: int, max_len: int) -> None:
        self.sched = Scheduler(scheduler.runner, scheduler.memory, scheduler.config)
        self.rng = random.Random(0)
        self.vocab = vocab
        self.max_len = max_len
        self.count = 0

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(min(n, self.max_len))]

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        for ids, sp in zip(prompts, params):
            self.count += 1
            self.sched.add(Req(f"warmup-{self.count}", ids, sp))
        while self.sched.has_work:
            self.sched.step()


def warm_up(scheduler: Scheduler, log: Callable[[str], None] | None = None
            ) -> dict[str, float]:
    """Runs the paths of the module docstring on `scheduler`'s runner and memory (the caller's
    scheduler itself is not touched and must be idle); returns {path: seconds}."""
    runner, memory = scheduler.runner, scheduler.memory
    report: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        report[name] = time.perf_counter() - t0
        if log is not None:
            log(f"warm-up {name}: {report[name]:.2f} s")

    if runner.device.type == "cpu":
        if any(isinstance(p, PackedLinearWeight) for p in runner.model.parameters()):
            timed("weight_packing", lambda: _pack_weights(runner.model))
        backend = runner.attn_backend
        if isinstance(backend, TorchAttentionBackend) and backend.cpu_kernel \
                and runner.pool.dtype == torch.float32:
            timed("cpu_decode_kernel", lambda: cpu_decode.load(block=True))
    if runner.cuda_graph is not None:
        report["cuda_graphs"] = runner.cuda_graph_capture_s
    # Prompts of a few lengths, at most a quarter of the context each (4 share the pool).
    max_len = max(2, min(memory.max_context_len // 4, 256))
    run = _Run(scheduler, runner.model_config.vocab_size, max_len)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    shared = run.prompt(48)
    timed("prefill", lambda: run.run(
        [shared, run.prompt(16), run.prompt(max_len)],
        [SamplingParams(max_tokens=1, ignore_eos=True)] * 3))
    timed("prefill_cached_prefix", lambda: run.run(
        [shared + run.prompt(8)], [SamplingParams(max_tokens=1, ignore_eos=True)]))
    timed("decode", lambda: run.run(
        [run.prompt(24) for _ in range(4)],
        [greedy, SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, seed=1,
                                ignore_eos=True),
         SamplingParams(max_tokens=4, temperature=0.7, repetition_penalty=1.1,
                        frequency_penalty=0.1, min_p=0.05, ignore_eos=True),
         SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)]))
    timed("decode_overlap", lambda: run.run([run.prompt(24) for _ in range(2)],
                                            [SamplingParams(max_tokens=8, temperature=0.0,
                                                            ignore_eos=True)] * 2))
    if runner.device.type == "cuda":
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        free = memory.stats().kv_pages_free * memory.page_size
        batches = extend_batches(scheduler.config.chunked_prefill_size, max_len, free)

        def sizes() -> None:
            for lens in batches:
                run.run([run.prompt(n) for n in lens], [one] * len(lens))
                memory.tree.reset()  # each batch fresh: no prefix of another

        timed("prefill_sizes", sizes)
    memory.tree.reset()
    stats = memory.stats()
    if stats.kv_pages_free != stats.kv_pages_total:
        raise RuntimeError(f"warm-up left {stats.kv_pages_total - stats.kv_pages_free} KV pages "
                           "in use")
    return report
