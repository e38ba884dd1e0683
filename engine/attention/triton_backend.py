"""Attention through our own Triton kernels (kernels/): KV store, split-KV paged decode, and
extend attention over a cached prefix. Reads the page-major pool through per-layer views.

Decode launches depend only on the batch size (lengths are read on the device), so a decode
pass is CUDA-graph safe: the split-KV kernel (`num_splits` fixed per batch size) below
`decode_worklist.uses_worklist`, the work-list kernel above it. A work list
(`decode_worklist.decode_plan`) is made on the device at the pass's first layer (a layer id not
above the previous call's starts a pass) and shared by the others, so a captured graph makes
it again at each replay.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str | None = None) -> None:
        # Imported here so the CPU serving path never needs triton.
        from pdserve.kernels import decode_attention, decode_worklist, extend_attention, kv_store
        from pdserve.kernels.device import num_sms

        self._store = kv_store.store_kv
        self._decode = decode_attention.decode_attention
        self._extend = extend_attention.extend_attention
        self._split_kv_for = decode_attention.split_kv_config
        self._worklist = decode_worklist
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self._num_sms = num_sms(dev)
        self._fb: ForwardBatch | None = None
        self._qo_indptr: torch.Tensor | None = None
        self._max_extend = 0
        self._split_kv = (1, 64)  # (num_splits, block_n) of this decode batch
        self._worklist_cfg: dict[str, int] | None = None  # set: this decode batch's work list
        self._decode_plan = None
        self._last_layer = -1

    def uses_worklist(self, batch_size: int, num_kv_heads: int) -> bool:
        """Whether a decode batch of this size takes the work-list kernel (else split-KV)."""
        return self._worklist.uses_worklist(batch_size, num_kv_heads, self._num_sms)

    def init_forward(self, fb: ForwardBatch) -> None:
        self._fb = fb
        self._qo_indptr = None
        self._decode_plan = None
        if fb.mode == ForwardMode.DECODE:
            b, hk = fb.batch_size, fb.kv_pool.num_kv_heads
            if self.uses_worklist(b, hk):
                self._worklist_cfg = self._worklist.worklist_config(b)
            else:
                self._worklist_cfg = None
                self._split_kv = self._split_kv_for(b, hk, self._num_sms)
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
            cfg = self._worklist_cfg
            if cfg is None:
                splits, block_n = self._split_kv
                return self._decode(q, kc, vc, fb.kv_indptr, fb.kv_indices, scale,
                                    num_splits=splits, block_n=block_n)
            if self._decode_plan is None or layer_id <= self._last_layer:  # a new pass
                self._decode_plan = self._worklist.decode_plan(
                    fb.kv_indptr, fb.batch_size, cfg["target_items"], cfg["block_n"])
            self._last_layer = layer_id
            return self._worklist.decode_attention_worklist(
                q, kc, vc, fb.kv_indptr, fb.kv_indices, scale, self._decode_plan,
                num_stages=cfg["num_stages"])
        return self._extend(q, kc, vc, qo_indptr, fb.kv_indptr, fb.kv_indices, scale,
                            max_extend_len=self._max_extend)
