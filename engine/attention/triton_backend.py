"""Attention through our own Triton kernels (kernels/): KV store, split-KV paged decode, and
extend attention over a cached prefix. Reads the page-major pool through per-layer views.

Decode launches depend only on the batch size (lengths are read on the device), so a decode
pass is CUDA-graph safe; `num_splits` is fixed per batch size.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str | None = None) -> None:
        # Imported here so the CPU serving path never needs triton.
        from pdserve.kernels import decode_attention, extend_attention, kv_store

        self._store = kv_store.store_kv
        self._decode = decode_attention.decode_attention
        self._extend = extend_attention.extend_attention
        self._num_splits_for = decode_attention.default_num_splits
        dev = torch.device(device) if device is not None else None
        self._num_sms = (torch.cuda.get_device_properties(dev).multi_processor_count
                         if dev is not None and dev.type == "cuda" else 4)
        self._fb: ForwardBatch | None = None
        self._qo_indptr: torch.Tensor | None = None
        self._max_extend = 0
        self._num_splits = 1

    def init_forward(self, fb: ForwardBatch) -> None:
        self._fb = fb
        self._qo_indptr = None
        if fb.mode == ForwardMode.DECODE:
            self._num_splits = self._num_splits_for(fb.batch_size, fb.kv_pool.num_kv_heads,
                                                    self._num_sms)
            return
        ext = fb.extend_lens
        self._qo_indptr = torch.zeros(ext.shape[0] + 1, dtype=torch.int64, device=ext.device)
        torch.cumsum(ext, 0, out=self._qo_indptr[1:])
        self._max_extend = (max(fb.extend_lens_cpu) if fb.extend_lens_cpu
                            else int(ext.max()) if ext.numel() else 0)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        fb: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        if self._fb is not fb:
            self.init_forward(fb)
        kc, vc = fb.kv_pool.k_view(layer_id), fb.kv_pool.v_view(layer_id)
        if k is not None:
            self._store(kc, vc, fb.out_cache_loc, k, v)
        if fb.num_tokens == 0:
            return q.new_empty(q.shape)
        if q.stride(-1) != 1:
            q = q.contiguous()
        qo_indptr = self._qo_indptr
        if fb.mode == ForwardMode.DECODE or qo_indptr is None:
            return self._decode(q, kc, vc, fb.kv_indptr, fb.kv_indices, scale,
                                num_splits=self._num_splits)
        return self._extend(q, kc, vc, qo_indptr, fb.kv_indptr, fb.kv_indices, scale,
                            max_extend_len=self._max_extend)
