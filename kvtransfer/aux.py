"""Aux data (first token, its logprob and top alternatives, cached token count) and decode's
aux slots.

Decode owns a registered aux buffer with one slot per in-flight room; the slot echoes the room so
a late write for a recycled slot is detected. A slot is held from init() until the room ends.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

# Top alternatives carried for the first token: at least the engine's MAX_LOGPROBS (a unit
# test holds the two together; kvtransfer does not import the engine).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class AuxData:
    """What decode needs besides the pages to continue a request: the first token, its logprob
    and its top alternatives (empty unless the request asked for top logprobs), and how many
    prompt tokens prefill served from its radix cache."""

    first_token_id: int
    first_logprob: float
    cached_tokens: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs):
            raise ValueError(f"top_logprobs: {len(self.top_logprobs)} logprobs for "
                             f"{len(self.top_ids)} token ids")
        if len(self.top_ids) > MAX_TOP_LOGPROBS:
            raise ValueError(f"top_ids: {len(self.top_ids)} alternatives, at most "
                             f"{MAX_TOP_LOGPROBS}")

    def to_dict(self) -> dict[str, object]:
        return {"first_token_id": self.first_token_id, "first_logprob": self.first_logprob,
                "cached_tokens": self.cached_tokens, "top_ids": list(self.top_ids),
                "top_logprobs": list(self.top_logprobs)}

    @classmethod
    def from_dict(cls, d: dict) -> AuxData:
        return cls(int(d["first_token_id"]), float(d["first_logprob"]), int(d["cached_tokens"]),
                   tuple(int(t) for t in d.get("top_ids", ())),
                   tuple(float(x) for x in d.get("top_logprobs", ())))


class AuxSlots:
    """`buffer[slot]` = room, first_token_id, logprob (float64 bits), cached_tokens, k, then
    MAX_TOP_LOGPROBS top ids and MAX_TOP_LOGPROBS top logprobs (float64 bits), k of them used."""

    WIDTH = 5 + 2 * MAX_TOP_LOGPROBS

    def __init__(self, num_slots: int) -> None:
        self.buffer = torch.zeros((num_slots, self.WIDTH), dtype=torch.int64)
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
        k = len(aux.top_ids)
        row[0] = room
        row[1] = aux.first_token_id
        row[2:3].view(torch.float64)[0] = aux.first_logprob
        row[3] = aux.cached_tokens
        row[4] = k
        top = 5 + MAX_TOP_LOGPROBS
        if k:
            row[5:5 + k] = torch.tensor(aux.top_ids, dtype=torch.int64)
            row[top:top + k].view(torch.float64)[:] = torch.tensor(aux.top_logprobs,
                                                                    dtype=torch.float64)

    def read(self, slot: int, room: int) -> AuxData | None:
        row = self.buffer[slot]
        if int(row[0]) != room:
            return None
        k = int(row[4])
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            return None
        top = 5 + MAX_TOP_LOGPROBS
        return AuxData(int(row[1]), float(row[2:3].view(torch.float64)[0]), int(row[3]),
                       tuple(row[5:5 + k].tolist()),
                       tuple(row[top:top + k].view(torch.float64).tolist()))
