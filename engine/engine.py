"""Build a ready-to-run engine (model, KV pool, memory, runner, scheduler) from configs.

With `tp_size` N > 1 the calling process is rank 0 of N: it starts the other ranks
(engine/tp/ranks.py), and every rank builds its runner with `build_runner`, in the same order
(the collectives in it line up): its shard of the model, a KV pool of its KV heads with as many
pages as the smallest rank can hold, its attention backend and, on CUDA, its graphs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.attention import cpu_decode
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig, parse_dtype
from pdserve.engine.cpu_linear import pack_linear_weights
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.memory import KVMemory
from pdserve.engine.model_runner import ModelRunner, default_attention_backend, num_kv_pages
from pdserve.engine.model_shapes import DEFAULT_LOAD_FORMAT
from pdserve.engine.models.layers import set_weight_layout
from pdserve.engine.tp.group import TPGroup, rank_device
from pdserve.engine.tp.layout import TPShard, check_tp
from pdserve.engine.tp.pools import PoolShare, RankPools
from pdserve.engine.tp.ranks import RankSet

# The decode-only worker's matmul weight layout (measured on an H200, docs/performance.md):
# row-major, which the batch-1 GEMV path needs (kernels/gemv.py; its steps 1.18x faster than
# cuBLAS with separate kernels), although cuBLASLt runs column-major weights ~1.5% faster at
# batch 64.
DECODE_WORKER_COLUMN_MAJOR = False


def resolve_device(device: str) -> str:
    """`auto` -> `cuda` when a GPU is there, else `cpu`; anything else unchanged."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None = the embedded default
    # A named shape (engine/model_shapes.py) with random weights and the embedded model's
    # tokenizer, instead of `model`.
    model_shape: str | None = None
    load_format: str = DEFAULT_LOAD_FORMAT  # auto: the checkpoint; dummy: its config, random
    device: str = "auto"  # auto: cuda when a GPU is there, else cpu (resolved at construction)
    dtype: str | None = None  # default float32 on CPU, bfloat16 on CUDA
    attention_backend: str | None = None
    disable_radix_cache: bool = False
    disable_cuda_graph: bool = False
    # fp32 on CPU: oneDNN-packed large weights for decode matmuls (engine/cpu_linear.py) and
    # the C++ paged decode attention (engine/attention/cpu_decode.py). Off: plain torch only.
    cpu_kernels: bool = True
    cuda_graph_max_bs: int = 256
    tp_size: int = 1  # tensor-parallel ranks (processes, one device each) of this engine
    # CUDA: matmul weights stored column-major (engine/models/layers.py): faster with cuBLAS
    # at decode batch sizes, slower for prefill-sized matmuls; decode-only workers use
    # DECODE_WORKER_COLUMN_MAJOR.
    column_major_weights: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device: must be auto, cpu or cuda[:N], got {self.device!r}")
        from pdserve.engine.model_shapes import check_load_format

        check_load_format(self.load_format)
        if self.model_shape is not None:
            from pdserve.engine.model_shapes import hf_config

            hf_config(self.model_shape)  # ValueError naming model_shape when unknown
            if self.model is not None:
                raise ValueError("model_shape: give either a model path or a model shape")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device: CUDA requested but no CUDA device is available")
        if self.dtype is not None:
            parse_dtype(self.dtype)
        if self.tp_size < 1:
            raise ValueError(f"tp_size: must be at least 1, got {self.tp_size}")
        if self.device.startswith("cuda"):
            last = rank_device(self.device, self.tp_size - 1).index
            if last >= torch.cuda.device_count():
                raise ValueError(f"tp_size: {self.tp_size} ranks from {self.device} need GPU "
                                 f"{last}, but {torch.cuda.device_count()} are visible")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return parse_dtype(self.dtype)
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32

    @property
    def dummy(self) -> bool:
        """Random weights: asked for, or implied by a model shape."""
        return self.load_format == "dummy" or self.model_shape is not None

    def model_path(self) -> str | None:
        """The checkpoint (None for a model shape: it has no files)."""
        if self.model is not None:
            return self.model
        if self.model_shape is not None:
            return None
        from pdserve.engine.default_model import default_model_path

        return default_model_path()

    def tokenizer_path(self) -> str:
        if self.model_shape is not None:
            from pdserve.engine.default_model import default_tokenizer_path

            return default_tokenizer_path()
        return self.model_path()  # type: ignore[return-value]

    def model_config(self) -> ModelConfig:
        """The model's config without loading weights (or fetching a tokenizer)."""
        from pdserve.engine.loader import read_model_config

        return read_model_config(self.model_path(), self.model_shape)


@dataclass
class EngineParts:
    config: EngineConfig
    runner: ModelRunner
    memory: KVMemory
    tokenizer: object
    load_s: float
    ranks: RankSet | None = None  # the other tensor-parallel ranks (tp_size > 1)
    pools: RankPools | None = None  # every rank's pool, mapped here (built with a PoolShare)

    def watch_ranks(self, on_lost: Callable[[str], None]) -> None:
        """`on_lost(message)` once, if a tensor-parallel rank dies; the runner refuses to run
        from then on."""
        if self.ranks is None:
            return

        def lost(message: str) -> None:
            self.runner.lost_rank = message
            on_lost(message)

        self.ranks.watch(lost)

    def close(self) -> None:
        """Stops the other tensor-parallel ranks, then releases the shared pools."""
        if self.ranks is not None:
            self.ranks.close(self.runner.tp)
        if self.pools is not None:
            self.pools.close()


def build_engine_parts(config: EngineConfig, pool_buffer: torch.Tensor | None = None,
                       share: PoolShare | None = None, with_tokenizer: bool = True
                       ) -> EngineParts:
    """Load the model (and tokenizer, unless a worker that never detokenizes says so) and size
    the KV pool. `pool_buffer`: externally owned pool memory (e.g. shared memory for same-host
    KV transfer), shaped like KVPool.buffer. `share`: every rank allocates its pool with it,
    and this process maps them all (`pools`)."""
    from pdserve.engine.loader import load_tokenizer
    from pdserve.engine.served_tokenizer import fold_vocab

    t0 = time.perf_counter()
    ranks = None
    if config.tp_size > 1:
        check_tp(config.model_config(), config.tp_size)  # before starting any rank
        ranks = RankSet(config, share)
    try:
        tp = ranks.connect() if ranks is not None else TPGroup()
        runner = build_runner(config, tp, pool_buffer, share,
                              (lambda stage, _="": ranks.wait(stage)) if ranks else None)
        pools = _rank_pools(config, runner, share, ranks) if share is not None else None
        tokenizer = None
        if with_tokenizer:
            tokenizer = load_tokenizer(config.tokenizer_path())
            if config.dummy:
                tokenizer = fold_vocab(tokenizer, runner.model_config.vocab_size)
    except BaseException:
        if ranks is not None:
            ranks.close(None)
        if share is not None:
            share.close()
        raise
    mc, cache = runner.model_config, config.cache
    # A request never holds more KV than the whole pool: a longer context could never be
    # admitted (or, decoding alone, would retract itself for ever), so it is refused up front.
    pool_tokens = (runner.pool.num_pages - 1) * runner.pool.page_size  # page 0 is reserved
    max_ctx = min(cache.max_context_len or mc.max_position_embeddings,
                  mc.max_position_embeddings, pool_tokens)
    memory = KVMemory(runner.pool, cache.max_reqs, max_ctx, config.disable_radix_cache)
    return EngineParts(config, runner, memory, tokenizer, time.perf_counter() - t0, ranks, pools)


def _rank_pools(config: EngineConfig, runner: ModelRunner, share: PoolShare,
                ranks: RankSet | None) -> RankPools:
    """Rank 0's pool and every other rank's, mapped from the handles they published."""
    mc, pool, size = runner.model_config, runner.pool, config.tp_size
    shards = [TPShard.of(mc, size, r) for r in range(size)]
    handles = [runner.pool_handle] + [ranks.value("pool", r) for r in range(1, size)]
    tensors = [pool.buffer] + [
        share.attach(handles[r], (pool.num_pages, *pool.buffer.shape[1:4],
                                  shards[r].num_kv_heads, mc.head_dim),
                     pool.dtype, rank_device(config.device, r)) for r in range(1, size)]
    return RankPools(tensors, handles, [(s.kv_head_start, s.num_kv_heads) for s in shards],
                     share.close)


def build_runner(config: EngineConfig, tp: TPGroup, pool_buffer: torch.Tensor | None = None,
                 share: PoolShare | None = None,
                 sync: Callable[[str, str], None] | None = None) -> ModelRunner:
    """This rank's model shard, KV pool, attention backend and runner. `sync(stage, value)`
    marks start-up stages between ranks (rank 0 waits for the others, they report; "pool"
    carries the handle of a pool allocated with `share`)."""
    from pdserve.engine.loader import load_model

    device = rank_device(config.device, tp.rank)
    dtype = config.torch_dtype
    model, model_config = load_model(config.model_path(), dtype=dtype, device=device, tp=tp,
                                     load_format=config.load_format,
                                     model_shape=config.model_shape)
    if sync is not None:
        sync("loading", "1")
    cache, shard = config.cache, model.shard
    local_pages = (int(pool_buffer.shape[0]) if pool_buffer is not None else num_kv_pages(
        model_config, cache, dtype, device, shard.num_kv_heads,
        ranks=tp.size if device.type == "cpu" else 1))
    num_pages = tp.min_int(local_pages)  # same page indices on every rank
    if pool_buffer is not None and num_pages != local_pages:
        raise ValueError(f"num_pages: rank {tp.rank}'s pool holds {local_pages} pages, "
                         f"another rank only {num_pages}")
    shape = (num_pages, model_config.num_layers, 2, cache.page_size, shard.num_kv_heads,
             model_config.head_dim)
    handle = ""
    if share is not None:
        pool_buffer, handle = share.create(shape, dtype, device)
    if sync is not None:
        sync("pool", handle)
    pool = KVPool(num_pages, model_config.num_layers, cache.page_size, shard.num_kv_heads,
                  model_config.head_dim, dtype, device, pool_buffer)
    backend = default_attention_backend(device, config.attention_backend,
                                        num_heads=shard.num_heads)
    if isinstance(backend, TorchAttentionBackend):
        backend.cpu_kernel = config.cpu_kernels
    if config.cpu_kernels and device.type == "cpu" and dtype == torch.float32:
        pack_linear_weights(model)
        # Start building (or loading) the C++ decode kernel now, off this thread; decode uses
        # torch ops until it is ready.
        cpu_decode.load(block=False)
    if device.type == "cuda" and config.column_major_weights:
        set_weight_layout(model.projection_weights(), column_major=True)
    runner = ModelRunner(model, model_config, pool, backend, tp)
    runner.pool_handle = handle
    if device.type == "cuda" and not config.disable_cuda_graph:
        runner.enable_cuda_graph(min(config.cuda_graph_max_bs, config.scheduler.max_running))
    tp.barrier()  # every rank is ready
    return runner
