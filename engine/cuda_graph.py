"""CUDA-graph decode runner: one captured decode forward per batch-size bucket.

Buckets are 1, 2, 4, 8, then multiples of 8 up to `max_batch_size` (rounded up to 8). They are
captured largest first into one memory pool, over static input buffers; a batch is padded to
the smallest bucket that holds it. Padding rows are sequences of one token whose only KV slot
is slot 0 (page 0, which the allocator never hands out), so they read and write nothing real.
The attention backend must be graph-safe: `triton` (lengths read on the device, grid fixed by
the batch size) or `flashinfer` (a `use_cuda_graph=True` decode wrapper per bucket, planned
before each replay into fixed buffers). Batches above the largest bucket run eagerly.

Graphs are captured with cuBLASLt as torch's preferred BLAS library (`blas`): on an H200 it ran
a Llama-3-8B layer's matmuls 1.07x (row-major weights) and 1.06x (column-major) faster than
cuBLAS at batch 64, 1.01-1.02x at 256 and within 1% at batches 1-8 (lm_head at 256 rows is ~1.1x
slower); whole graph steps over column-major weights at batch 64 were 1.03x faster
(docs/performance.md). The choice is baked into each graph; eager passes keep the process-wide
setting.

Under tensor parallelism every rank captures the same buckets in the same order, with the
model's all-reduces and its logits all-gather inside the graphs (NCCL work is captured like any
kernel), and replays the bucket that rank 0 announced.

Invariant: the logits a replay returns are a view of the bucket's static output and stay valid
only until the next replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.kv_pool import KVPool


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_batch_size rounded up to a multiple of 8."""
    if max_batch_size <= 0:
        raise ValueError(f"max_batch_size: must be positive, got {max_batch_size}")
    small = [b for b in (1, 2, 4, 8) if b < max_batch_size] or [1]
    top = max(8, -(-max_batch_size // 8) * 8) if max_batch_size > 4 else max_batch_size
    return sorted(set(small + list(range(8, top + 1, 8)) + [top]))


@contextmanager
def preferred_blas(name: str | None) -> Iterator[None]:
    """torch's preferred BLAS library (`cublas` / `cublaslt`) inside the block; None: unchanged."""
    if name is None:
        yield
        return
    saved = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(saved)


class CudaGraphDecodeRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, backend: AttentionBackend,
                 max_batch_size: int = 256, blas: str | None = "cublaslt") -> None:
        from pdserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend
        from pdserve.engine.attention.triton_backend import TritonAttentionBackend

        if not isinstance(backend, (FlashInferAttentionBackend, TritonAttentionBackend)):
            raise TypeError(f"attention_backend: {type(backend).__name__} is not CUDA-graph "
                            "safe (use flashinfer or triton)")
        if pool.device.type != "cuda":
            raise ValueError(f"device: CUDA graphs need a CUDA pool, got {pool.device}")
        self.model = model
        self.pool = pool
        self.backend = backend
        self.is_flashinfer = isinstance(backend, FlashInferAttentionBackend)
        cfg = model.config
        self.num_heads = model.shard.num_heads  # this rank's (all of them without TP)
        self.scale = cfg.head_dim**-0.5
        self.buckets = batch_size_buckets(max_batch_size)
        max_bs = self.buckets[-1]
        dev, i64 = pool.device, torch.int64
        self.input_ids = torch.zeros(max_bs, dtype=i64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=i64, device=dev)
        self.out_cache_loc = torch.zeros(max_bs, dtype=i64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=i64, device=dev)
        self.prefix_lens = torch.zeros(max_bs, dtype=i64, device=dev)
        self.extend_lens = torch.ones(max_bs, dtype=i64, device=dev)
        self.kv_indptr = torch.arange(max_bs + 1, dtype=i64, device=dev)
        self._steps = torch.arange(max_bs + 1, dtype=i64, device=dev)
        # Every live token is in the pool once, plus one slot per padding row.
        self.kv_indices = torch.zeros(pool.num_pages * pool.page_size + max_bs, dtype=i64,
                                      device=dev)
        i32 = torch.int32
        self._fi_indptr = torch.zeros(max_bs + 1, dtype=i32, device=dev)
        self._fi_indices = torch.zeros(pool.num_pages + max_bs, dtype=i32, device=dev)
        self._fi_last = torch.ones(max_bs, dtype=i32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.wrappers: dict[int, object] = {}
        self.mem_pool = None
        self.blas = blas

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs], extend_lens=self.extend_lens[:bs],
            kv_indptr=self.kv_indptr[:bs + 1], kv_indices=self.kv_indices, kv_pool=self.pool,
            attn_backend=self.backend, seq_lens_cpu=[1] * bs, extend_lens_cpu=[1] * bs)

    def _plan(self, bs: int, fb: ForwardBatch) -> None:
        if self.is_flashinfer:
            self.backend.set_decode_wrapper(self.wrappers[bs])  # type: ignore[attr-defined]
            self.backend.plan(fb, self.num_heads, self.scale)  # type: ignore[attr-defined]
            self.backend.set_decode_wrapper(None)  # type: ignore[attr-defined]
        else:
            self.backend.init_forward(fb)

    def _make_wrapper(self, bs: int) -> object:
        import flashinfer

        tc = self.backend.use_tensor_cores(  # type: ignore[attr-defined]
            self.num_heads, self.pool.num_kv_heads)
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.backend.workspace, "NHD", use_cuda_graph=True,  # type: ignore[attr-defined]
            use_tensor_cores=tc, paged_kv_indptr_buffer=self._fi_indptr[:bs + 1],
            paged_kv_indices_buffer=self._fi_indices,
            paged_kv_last_page_len_buffer=self._fi_last[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, into one graph memory pool."""
        self.mem_pool = torch.cuda.graph_pool_handle()
        with preferred_blas(self.blas):
            for bs in reversed(self.buckets):
                self._capture(bs)
        torch.cuda.synchronize()

    def _capture(self, bs: int) -> None:
        fb = self._static_batch(bs)
        if self.is_flashinfer:
            self.wrappers[bs] = self._make_wrapper(bs)
        self._plan(bs, fb)
        for _ in range(2):  # compile / JIT and settle allocations outside the capture
            self.model(fb)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mem_pool):
            self.outputs[bs] = self.model(fb)
        self.graphs[bs] = graph
        self.batches[bs] = fb

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.mode == ForwardMode.DECODE and bool(self.graphs)
                and 0 < fb.batch_size <= self.buckets[-1])

    def bucket_for(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] of the decode batch `fb` (a view of static memory, see above)."""
        bs = fb.batch_size
        bucket = self.bucket_for(bs)
        static = self.batches[bucket]
        seq_lens_cpu = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens.tolist()
        n = int(fb.kv_indices.shape[0])
        pad = bucket - bs
        for dst, src, fill in ((self.input_ids, fb.input_ids, 0),
                               (self.positions, fb.positions, 0),
                               (self.out_cache_loc, fb.out_cache_loc, 0),
                               (self.seq_lens, fb.seq_lens, 1),
                               (self.prefix_lens, fb.prefix_lens, 0)):
            dst[:bs].copy_(src, non_blocking=True)
            dst[bs:bucket].fill_(fill)
        self.kv_indptr[:bs + 1].copy_(fb.kv_indptr, non_blocking=True)
        # Padding row j (0-based) owns the single slot at n + j, which holds slot 0.
        torch.add(self._steps[1:pad + 1], n, out=self.kv_indptr[bs + 1:bucket + 1])
        self.kv_indices[:n].copy_(fb.kv_indices, non_blocking=True)
        self.kv_indices[n:n + pad].zero_()
        static.seq_lens_cpu = [*seq_lens_cpu, *([1] * pad)]
        self._plan(bucket, static)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:bs]
