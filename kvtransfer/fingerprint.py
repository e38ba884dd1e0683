"""Compatibility fingerprint compared at handshake; a mismatch is refused naming the field."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

PROTOCOL_VERSION = 3  # 2: binary chunk headers and page lists; 3: top logprobs in aux
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

    @classmethod
    def from_pool_buffer(cls, model: str, buffer: torch.Tensor) -> Fingerprint:
        """Fingerprint of a page-major pool tensor."""
        if buffer.dim() != 6 or buffer.shape[2] != 2:
            raise ValueError(f"buffer: not page-major (got shape {tuple(buffer.shape)})")
        _, layers, _, page_size, heads, head_dim = buffer.shape
        return cls(model, int(layers), int(heads), int(head_dim), int(page_size),
                   str(buffer.dtype).removeprefix("torch."))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Fingerprint:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})  # type: ignore[arg-type]

    def mismatch(self, other: Fingerprint, self_name: str = "local",
                 other_name: str = "peer") -> str | None:
        """None when compatible, else a message naming the first differing field."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                return (f"fingerprint mismatch: {f.name}: {self_name} has {a!r}, "
                        f"{other_name} has {b!r}")
        return None

    def check(self, other: Fingerprint) -> None:
        msg = self.mismatch(other)
        if msg is not None:
            raise FingerprintMismatch(msg)
