"""The page-major KV pool: one tensor `[num_pages, num_layers, 2, page_size, kv_heads, head_dim]`.

One page of all layers is one contiguous region, so a request's KV moves between workers as a
few large descriptors (runs of consecutive pages). Attention reads per-layer strided views.
Page 0 is never handed out by the allocator: padded slots in CUDA graphs write there.
Under tensor parallelism each rank has a pool of its own KV heads, with the same number of
pages: rank 0's allocator hands out page indices that mean the same page on every rank.
"""

from __future__ import annotations

import torch

from pdserve.engine.config import CacheConfig, ModelConfig


class KVPool:
    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        buffer: torch.Tensor | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages: need at least 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        if buffer is not None:
            # Externally owned memory (a shared-memory segment, a registered region).
            if tuple(buffer.shape) != shape or buffer.dtype != dtype:
                raise ValueError(
                    f"buffer: expected {shape} {dtype}, got {tuple(buffer.shape)} {buffer.dtype}")
            self.buffer = buffer
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        # Per-layer views [num_pages, page_size, kv_heads, head_dim]; strided, never copied.
        self._k = [self.buffer[:, layer, 0] for layer in range(num_layers)]
        self._v = [self.buffer[:, layer, 1] for layer in range(num_layers)]

    @classmethod
    def for_model(
        cls, model: ModelConfig, cache: CacheConfig, num_pages: int, dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVPool:
        return cls(num_pages, model.num_layers, cache.page_size, model.num_kv_heads,
                   model.head_dim, dtype, device)

    @staticmethod
    def page_bytes_for(model: ModelConfig, page_size: int, dtype: torch.dtype,
                       num_kv_heads: int | None = None) -> int:
        """Bytes of one page (all layers) holding `num_kv_heads` (default: all of them)."""
        elem = torch.empty((), dtype=dtype).element_size()
        heads = model.num_kv_heads if num_kv_heads is None else num_kv_heads
        return model.num_layers * 2 * page_size * heads * model.head_dim * elem

    @property
    def page_bytes(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    def k_view(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v_view(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([T, kv_heads, head_dim]) at token slots [T]."""
        if self.buffer.is_contiguous():
            # Rows of the flat view: index_copy_ of whole rows is a run of small memcpys, far
            # faster than advanced indexing of the strided per-layer view.
            rows = self.k_rows(layer, slots)
            flat = self.buffer.view(-1, self.num_kv_heads, self.head_dim)
            flat.index_copy_(0, rows, k.to(self.dtype))
            flat.index_copy_(0, rows + self.page_size, v.to(self.dtype))
            return
        pages = torch.div(slots, self.page_size, rounding_mode="floor")
        offs = slots - pages * self.page_size
        self._k[layer][pages, offs] = k.to(self.dtype)
        self._v[layer][pages, offs] = v.to(self.dtype)

    def k_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Row indices of K for `slots` in `buffer.view(-1, kv_heads, head_dim)`; V rows are
        these + page_size."""
        ps = self.page_size
        pages = torch.div(slots, ps, rounding_mode="floor")
        return pages * (self.num_layers * 2 * ps) + (slots - pages * ps) + layer * 2 * ps

    def get_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at token slots (any shape S) -> [*S, kv_heads, head_dim] each (a gather copy)."""
        pages = torch.div(slots, self.page_size, rounding_mode="floor")
        offs = slots - pages * self.page_size
        return self._k[layer][pages, offs], self._v[layer][pages, offs]
