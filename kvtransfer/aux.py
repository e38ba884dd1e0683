"""Aux data (first token, its logprob, cached token count) and decode's aux slots.

Decode owns a registered aux buffer with one slot per in-flight room; the slot echoes the room so
a late write for a recycled slot is detected. A slot is held from init() until the room ends.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AuxData:
    first_token_id: int
    first_logprob: float
    cached_tokens: int

    def to_dict(self) -> dict[str, float | int]:
        return {"first_token_id": self.first_token_id, "first_logprob": self.first_logprob,
                "cached_tokens": self.cached_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, float | int]) -> AuxData:
        return cls(int(d["first_token_id"]), float(d["first_logprob"]), int(d["cached_tokens"]))


class AuxSlots:
    """`buffer[slot] = (room, first_token_id, logprob as float64 bits, cached_tokens)`."""

    def __init__(self, num_slots: int) -> None:
        self.buffer = torch.zeros((num_slots, 4), dtype=torch.int64)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    def alloc(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        with self._lock:
            self.buffer[slot].zero_()
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def write(self, slot: int, room: int, aux: AuxData) -> None:
        row = self.buffer[slot]
        row[0] = room
        row[1] = aux.first_token_id
        row[2:3].view(torch.float64)[0] = aux.first_logprob
        row[3] = aux.cached_tokens

    def read(self, slot: int, room: int) -> AuxData | None:
        row = self.buffer[slot]
        if int(row[0]) != room:
            return None
        return AuxData(int(row[1]), float(row[2:3].view(torch.float64)[0]), int(row[3]))
