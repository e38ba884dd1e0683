"""Build a ready-to-run engine (model, KV pool, memory, runner, scheduler) from configs."""

from __future__ import annotations

import time
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

# The decode-only worker's matmul weight layout (measured on an H200, docs/performance.md):
# row-major, which the batch-1 GEMV path needs (kernels/gemv.py; its steps 1.18x faster than
# cuBLAS with separate kernels), although cuBLASLt runs column-major weights ~1.5% faster at
# batch 64.
DECODE_WORKER_COLUMN_MAJOR = False


DEVICES = ("auto", "cpu", "cuda")


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


def build_engine_parts(config: EngineConfig, pool_buffer: torch.Tensor | None = None,
                       with_tokenizer: bool = True) -> EngineParts:
    """Load the model (and tokenizer, unless a worker that never detokenizes says so) and size
    the KV pool. `pool_buffer`: externally owned pool memory (e.g. shared memory for same-host
    KV transfer), shaped like KVPool.buffer."""
    from pdserve.engine.loader import load_model, load_tokenizer
    from pdserve.engine.served_tokenizer import fold_vocab

    t0 = time.perf_counter()
    device = torch.device(config.device)
    dtype = config.torch_dtype
    model, model_config = load_model(config.model_path(), dtype, device, config.load_format,
                                     config.model_shape)
    tokenizer = None
    if with_tokenizer:
        tokenizer = load_tokenizer(config.tokenizer_path())
        if config.dummy:
            tokenizer = fold_vocab(tokenizer, model_config.vocab_size)
    cache = config.cache
    max_ctx = min(cache.max_context_len or model_config.max_position_embeddings,
                  model_config.max_position_embeddings)
    num_pages = (int(pool_buffer.shape[0]) if pool_buffer is not None
                 else num_kv_pages(model_config, cache, dtype, device))
    pool = KVPool.for_model(model_config, cache, num_pages, dtype, device) if pool_buffer is None \
        else KVPool(num_pages, model_config.num_layers, cache.page_size,
                    model_config.num_kv_heads, model_config.head_dim, dtype, device, pool_buffer)
    memory = KVMemory(pool, cache.max_reqs, max_ctx, config.disable_radix_cache)
    backend = default_attention_backend(device, config.attention_backend,
                                        num_heads=model_config.num_heads)
    if isinstance(backend, TorchAttentionBackend):
        backend.cpu_kernel = config.cpu_kernels
    if config.cpu_kernels and device.type == "cpu" and dtype == torch.float32:
        pack_linear_weights(model)
        # Start building (or loading) the C++ decode kernel now, off this thread; decode uses
        # torch ops until it is ready.
        cpu_decode.load(block=False)
    if device.type == "cuda" and config.column_major_weights:
        set_weight_layout(model.projection_weights(), column_major=True)
    runner = ModelRunner(model, model_config, pool, backend)
    if device.type == "cuda" and not config.disable_cuda_graph:
        runner.enable_cuda_graph(min(config.cuda_graph_max_bs, config.scheduler.max_running))
    return EngineParts(config, runner, memory, tokenizer, time.perf_counter() - t0)
