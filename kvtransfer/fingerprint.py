"""Compatibility fingerprint compared at handshake; a mismatch is refused naming the field."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from pdserve.kvtransfer.lanes import KVLayout

# 2: binary chunk headers and page lists; 3: top logprobs in aux; 4: tensor-parallel layouts
# (a chunk's parts for every decode rank travel together)
PROTOCOL_VERSION = 4
LAYOUT = "page-major"  # [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]


class FingerprintMismatch(ValueError):
    """Raised (or reported as a room's failure reason) when two workers' KV are incompatible."""


@dataclass(frozen=True)
class Fingerprint:
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    layout: str = LAYOUT
    protocol_version: int = PROTOCOL_VERSION
    # Tensor-parallel ranks' KV heads, (first, count) each: the pools the worker's KV spans.
    # Empty: one pool of every head. Compared by mapping it (lanes.plan_lanes), not equality.
    kv_ranks: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_pool_buffer(cls, model: str, buffer: torch.Tensor,
                         layout: KVLayout | None = None) -> Fingerprint:
        """Fingerprint of a page-major pool tensor; with `layout`, of a worker whose KV spans
        one such pool per tensor-parallel rank (`buffer` is rank 0's)."""
        if buffer.dim() != 6 or buffer.shape[2] != 2:
            raise ValueError(f"buffer: not page-major (got shape {tuple(buffer.shape)})")
        _, layers, _, page_size, heads, head_dim = buffer.shape
        if layout is not None and layout.ranks[0][1] != heads:
            raise ValueError(f"layout: rank 0 holds {layout.ranks[0][1]} KV heads, its pool "
                             f"{heads}")
        ranks = () if layout is None or layout.tp == 1 else layout.ranks
        return cls(model, int(layers), int(heads) if layout is None else layout.num_kv_heads,
                   int(head_dim), int(page_size), str(buffer.dtype).removeprefix("torch."),
                   kv_ranks=ranks)

    @property
    def kv_layout(self) -> KVLayout:
        if not self.kv_ranks:
            return KVLayout.single(self.num_kv_heads)
        return KVLayout(self.num_kv_heads, self.kv_ranks)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Fingerprint:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["kv_ranks"] = tuple((int(a), int(b)) for a, b in kw.get("kv_ranks", ()))
        return cls(**kw)  # type: ignore[arg-type]

    def mismatch(self, other: Fingerprint, self_name: str = "local",
                 other_name: str = "peer") -> str | None:
        """None when compatible, else a message naming the first differing field. Layouts of
        tensor-parallel ranks are not compared here: lanes.plan_lanes maps them."""
        for f in fields(self):
            if f.name == "kv_ranks":
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                return (f"fingerprint mismatch: {f.name}: {self_name} has {a!r}, "
                        f"{other_name} has {b!r}")
        return None

    def check(self, other: Fingerprint) -> None:
        msg = self.mismatch(other)
        if msg is not None:
            raise FingerprintMismatch(msg)
