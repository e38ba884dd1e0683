"""ModelRunner: a loaded model, its KV pool, an attention backend, and the sampler.

It turns a ScheduleBatch into logits (one forward pass) and logits into tokens. It owns no
scheduling state; the Scheduler decides what runs. Under tensor parallelism the runner of rank 0
announces each pass to the other ranks (engine/tp/step.py) before running it; theirs run the
same pass from the announcement (`run`), over their own shards and KV pools.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.req import Req
from pdserve.engine.sampler import SampleOutput, Sampler, SamplingBatch
from pdserve.engine.schedule_batch import ScheduleBatch
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.step import send_forward


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def num_kv_pages(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                 device: torch.device, num_kv_heads: int | None = None, ranks: int = 1) -> int:
    """Pool size: `cache.num_pages`, else a fraction of free GPU memory (or of a host budget).
    Tensor-parallel ranks size their own pools (`num_kv_heads` each); on a host, the `ranks`
    of a worker share its budget."""
    if cache.num_pages is not None:
        return cache.num_pages
    page_bytes = KVPool.page_bytes_for(model, cache.page_size, dtype, num_kv_heads)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * cache.mem_fraction
    else:
        # Host memory is shared with other workers on the machine: a quarter of it at most.
        budget = _host_memory_bytes() * 0.25 * cache.mem_fraction / ranks
    max_ctx = cache.max_context_len or model.max_position_embeddings
    # Never more than enough for every request slot at full context.
    cap = cache.max_reqs * (-(-max_ctx // cache.page_size)) + 1
    return max(2, min(int(budget // page_bytes), cap))


def default_attention_backend(device: torch.device, name: str | None = None,
                              num_heads: int | None = None) -> AttentionBackend:
    """`torch` on CPU; on CUDA `flashinfer` when importable, else `triton`, unless `name` picks
    one (`torch`, `triton`, `flashinfer`). `num_heads` lets FlashInfer plan in init_forward."""
    from pdserve.engine.attention.torch_backend import TorchAttentionBackend

    device = torch.device(device)
    if name not in (None, "torch", "triton", "flashinfer"):
        raise ValueError(f"attention_backend: unknown {name!r}")
    if device.type != "cuda":
        if name not in (None, "torch"):
            raise ValueError(f"attention_backend: {name!r} needs a CUDA device")
        return TorchAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    if name in (None, "flashinfer"):
        try:
            from pdserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend

            return FlashInferAttentionBackend(device, num_heads)
        except ImportError:
            if name == "flashinfer":
                raise
    try:
        from pdserve.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    except ImportError:
        if name == "triton":
            raise
    return TorchAttentionBackend()


@dataclass
class RunnerSpec:
    model_path: str
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    attention_backend: str | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, pool: KVPool,
                 attn_backend: AttentionBackend, tp: TPGroup | None = None) -> None:
        self.model = model
        self.model_config = model_config
        self.pool = pool
        self.attn_backend = attn_backend
        self.device = pool.device
        self.tp = tp if tp is not None else TPGroup()
        self.sampler = Sampler()
        self.cuda_graph = None  # a CudaGraphDecodeRunner once enable_cuda_graph() captured
        self.cuda_graph_capture_s = 0.0
        self.lost_rank: str | None = None  # set when a tensor-parallel rank died
        self.pool_handle = ""  # how other processes of the worker map the pool (PoolShare)

    def enable_cuda_graph(self, max_batch_size: int = 256) -> None:
        """Captures decode CUDA graphs for batch sizes up to `max_batch_size` (CUDA only;
        larger decode batches and every extend batch stay eager)."""
        from pdserve.engine.cuda_graph import CudaGraphDecodeRunner

        t0 = time.perf_counter()
        runner = CudaGraphDecodeRunner(self.model, self.pool, self.attn_backend, max_batch_size)
        runner.capture()
        self.cuda_graph = runner
        self.cuda_graph_capture_s = time.perf_counter() - t0

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch, memory,
                fix_inputs: Callable[[ForwardBatch], None] | None = None) -> torch.Tensor:
        """Logits [B, vocab] of the last new token of each request. `fix_inputs` may patch the
        built batch on the device first (overlap: input ids still on the device)."""
        host = batch.host_batch(memory.req_to_token.table)
        patched = fix_inputs is not None
        if self.tp.size > 1:
            if self.lost_rank is not None:
                raise RuntimeError(self.lost_rank)
            send_forward(self.tp, host, ids_on_device=patched)
        fb = host.to_forward_batch(self.pool, self.attn_backend, self.device)
        if fix_inputs is not None:
            fix_inputs(fb)
        return self.run(fb, ids_on_device=patched)

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, ids_on_device: bool = False) -> torch.Tensor:
        """The forward pass of `fb` on this rank (every rank of a tensor-parallel group runs
        it, in the same order). `ids_on_device`: rank 0 patched the input ids on its device;
        they are broadcast from there."""
        if ids_on_device and self.tp.size > 1:
            self.tp.broadcast_(fb.input_ids)
        if self.cuda_graph is not None and self.cuda_graph.can_run(fb):
            # A view of the graph's static output: consumed (sampled) before the next step.
            return self.cuda_graph.replay(fb)
        self.attn_backend.init_forward(fb)
        return self.model(fb)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampleOutput:
        sb = SamplingBatch.build(
            [r.sampling for r in reqs],
            [r.output_ids for r in reqs],
            [r.input_ids for r in reqs],
            self.model_config.vocab_size,
            logits.device,
            eos_token_ids=tuple(self.model_config.eos_token_ids),
        )
        return self.sampler.sample(logits, sb)
