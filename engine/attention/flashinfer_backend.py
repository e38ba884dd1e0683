"""Attention through FlashInfer's paged wrappers, reading the page-major pool's per-layer views.

Plan once per batch (an extend batch at the first layer's attention, the GPU busy with the
embedding and the first projections meanwhile), run once per layer. EXTEND with no cached
prefix in the batch (a fresh prefill) uses BatchPrefillWithRaggedKVCacheWrapper on the new K/V
as they come out of the projection (causal; they are still stored into the pool for decode and
transfer): it needs no page tables and reads contiguous rows, 1.23x faster than the paged
kernel on a 4096-token prompt on an H200 (docs/performance.md). EXTEND over a cached prefix uses
BatchPrefillWithPagedKVCacheWrapper (causal, over prefix + new tokens, whose K/V are stored
first). DECODE uses BatchDecodeWithPagedKVCacheWrapper, with tensor cores when the GQA
group is >= 4, except where our Triton kernels were faster on an H200 at context 1k
(docs/performance.md): batches of at most SMALL_DECODE_BATCH sequences run the split-KV kernel
(kernels/decode_attention.py; 7.6 / 17.1 µs per layer at batch 1 / 8 against FlashInfer's 9.1 /
18.8) and batches of `decode_worklist.uses_worklist` size the work-list kernel
(kernels/decode_worklist.py; the batch-256 step 1.031x faster than with FlashInfer's decode,
and it cuts a long sequence among short ones into chunks where FlashInfer's CUDA-graph decode
took 4x longer). In between FlashInfer decodes (72.4 µs per layer at batch 64 against 75.9 for
the work list and 87.8 for the split-KV kernel). `flashinfer_decode_only` (default:
PDSERVE_FLASHINFER_DECODE, pdserve/envs.py) gives every decode batch to FlashInfer. FlashInfer
picks its FA3 kernels on Hopper for both prefill wrappers.

FlashInfer wants page-level tables: each sequence's token slots are page-aligned
runs (offset j of a sequence sits at offset j % page_size of its page), so its pages are
`kv_indices[kv_indptr[i]::page_size] // page_size` and its last page holds
`(seq_len - 1) % page_size + 1` tokens. Those index positions are computed on the host from
the host copies of the lengths, so planning needs no device sync.

For CUDA graphs, `engine/cuda_graph.py` installs a decode wrapper built with
`use_cuda_graph=True` (fixed batch size, fixed buffers) via `set_decode_wrapper`.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.attention.triton_backend import TritonAttentionBackend
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.envs import envs

WORKSPACE_BYTES = 256 << 20
SMALL_DECODE_BATCH = 8


def page_tables(fb: ForwardBatch, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(page_indptr [B+1] int32 host, page_indices [N] int32 device, last_page_len [B] int32
    host) for FlashInfer, from the token-level `kv_indptr` / `kv_indices`.

    Nothing here waits for the GPU: the page indices are gathered on the device from device
    tensors (only their count comes from the host lengths), and the host tables are pinned so
    that FlashInfer's copies of them are asynchronous. A copy from pageable memory would sync
    the stream and stall the CPU behind the step already running (no overlap)."""
    ps = fb.kv_pool.page_size
    seq_lens = torch.tensor(fb.seq_lens_cpu if fb.seq_lens_cpu is not None
                            else fb.seq_lens.tolist(), dtype=torch.int64)
    num_pages = (seq_lens + ps - 1) // ps
    page_indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(num_pages, 0, out=page_indptr[1:])
    total = int(page_indptr[-1])
    dev_pages = (fb.seq_lens.to(torch.int64) + ps - 1) // ps
    seq_of_page = torch.repeat_interleave(
        torch.arange(dev_pages.shape[0], device=dev_pages.device), dev_pages, output_size=total)
    first_page = torch.cumsum(dev_pages, 0) - dev_pages
    j = torch.arange(total, device=dev_pages.device) - first_page[seq_of_page]
    token_pos = fb.kv_indptr[:-1].to(torch.int64)[seq_of_page] + j * ps
    pages = torch.div(fb.kv_indices[token_pos], ps, rounding_mode="floor").to(torch.int32)
    last = ((seq_lens - 1) % ps + 1).to(torch.int32)
    page_indptr = page_indptr.to(torch.int32)
    if device.type == "cuda":
        page_indptr, last = page_indptr.pin_memory(), last.pin_memory()
    return page_indptr, pages.to(device), last


def no_prefix(fb: ForwardBatch) -> bool:
    """Whether no sequence of the batch has KV cached before this pass (host lengths only)."""
    if fb.seq_lens_cpu is not None and fb.extend_lens_cpu is not None:
        return list(fb.seq_lens_cpu) == list(fb.extend_lens_cpu)
    return bool((fb.seq_lens == fb.extend_lens).all())


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str, num_heads: int | None = None) -> None:
        import flashinfer

        from pdserve.kernels.kv_store import store_kv

        self._flashinfer = flashinfer
        self._store = store_kv
        self._triton_decode = TritonAttentionBackend(device)
        self.flashinfer_decode_only = envs().flashinfer_decode
        self.device = torch.device(device)
        self.num_heads = num_heads  # known up front, or taken from the first layer's q
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self._decode: dict[bool, object] = {}  # use_tensor_cores -> eager decode wrapper
        self._graph_decode: object | None = None
        self._fb: ForwardBatch | None = None
        self._planned: ForwardBatch | None = None
        self._wrapper: object | None = None
        self._scale = 0.0
        self.lazy_extend_plan = True

    def triton_decodes(self, batch_size: int, num_kv_heads: int) -> bool:
        """Whether a decode batch of this size runs a Triton kernel (else FlashInfer's)."""
        return not self.flashinfer_decode_only and (
            batch_size <= SMALL_DECODE_BATCH
            or self._triton_decode.uses_worklist(batch_size, num_kv_heads))

    @staticmethod
    def use_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
        return num_heads // num_kv_heads >= 4

    def set_decode_wrapper(self, wrapper: object | None) -> None:
        """A CUDA-graph decode wrapper for the next plans (None: back to the eager ones)."""
        self._graph_decode = wrapper

    def _decode_wrapper(self, tensor_cores: bool) -> object:
        if self._graph_decode is not None:
            return self._graph_decode
        if tensor_cores not in self._decode:
            self._decode[tensor_cores] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores)
        return self._decode[tensor_cores]

    def init_forward(self, fb: ForwardBatch) -> None:
        """Plans a decode batch now; an extend batch waits for the first layer's attention (by
        then the embedding and the first projections are queued, so the GPU works while the
        host plans), unless `lazy_extend_plan` is off."""
        self._fb = fb
        if self.num_heads is not None and (fb.mode == ForwardMode.DECODE
                                           or not self.lazy_extend_plan):
            self.plan(fb, self.num_heads, fb.kv_pool.head_dim**-0.5)

    def plan(self, fb: ForwardBatch, num_heads: int, scale: float) -> None:
        pool = fb.kv_pool
        self._fb = fb
        self._scale = scale
        if fb.num_tokens == 0:
            self._planned = fb
            return
        common = {"q_data_type": pool.dtype, "kv_data_type": pool.dtype, "sm_scale": scale,
                  "non_blocking": True}
        if fb.mode != ForwardMode.DECODE and no_prefix(fb):
            qo_indptr = self._qo_indptr(fb)
            self._wrapper = self._ragged
            self._ragged.plan(qo_indptr, qo_indptr, num_heads, pool.num_kv_heads, pool.head_dim,
                              causal=True, **common)
            self._planned = fb
            return
        if fb.mode == ForwardMode.DECODE and self.triton_decodes(fb.batch_size,
                                                                  pool.num_kv_heads):
            self._wrapper = None  # the Triton backend's decode: reads token slots, no tables
            self._triton_decode.init_forward(fb)
            self._planned = fb
            return
        indptr, indices, last = page_tables(fb, self.device)
        if fb.mode == ForwardMode.DECODE:
            tc = self.use_tensor_cores(num_heads, pool.num_kv_heads)
            self._wrapper = self._decode_wrapper(tc)
            self._wrapper.plan(indptr, indices, last, num_heads, pool.num_kv_heads,
                               pool.head_dim, pool.page_size, **common)
        else:
            self._wrapper = self._prefill
            self._prefill.plan(self._qo_indptr(fb), indptr, indices, last, num_heads,
                               pool.num_kv_heads, pool.head_dim, pool.page_size, causal=True,
                               **common)
        self._planned = fb

    def _qo_indptr(self, fb: ForwardBatch) -> torch.Tensor:
        ext = torch.tensor(fb.extend_lens_cpu if fb.extend_lens_cpu is not None
                           else fb.extend_lens.tolist(), dtype=torch.int64)
        qo_indptr = torch.zeros(ext.shape[0] + 1, dtype=torch.int32)
        torch.cumsum(ext, 0, out=qo_indptr[1:])
        return qo_indptr.pin_memory() if self.device.type == "cuda" else qo_indptr

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        fb: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        pool = fb.kv_pool
        kc, vc = pool.k_view(layer_id), pool.v_view(layer_id)
        if k is not None:
            self._store(kc, vc, fb.out_cache_loc, k, v)
        if fb.num_tokens == 0:
            return q.new_empty(q.shape)
        if self._planned is not fb or abs(scale - self._scale) > 1e-12:
            if self.num_heads is not None and self.num_heads != q.shape[1]:
                raise ValueError(f"num_heads: planned {self.num_heads}, q has {q.shape[1]}")
            self.plan(fb, q.shape[1], scale)
        if self._wrapper is None:  # K/V stored above
            return self._triton_decode.forward(layer_id, q, None, None, fb, scale)
        if self._wrapper is self._ragged:
            if k is None or v is None:
                raise ValueError("k: the ragged prefill reads the new K/V, pass them")
            return self._ragged.run(q, k, v)
        return self._wrapper.run(q, (kc, vc))  # type: ignore[attr-defined]
