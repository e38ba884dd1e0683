"""Request-to-token table: one row per live request, mapping token positions to KV slots.

`table[row, i]` is the slot of token i of the request that holds `row`. The table only records
where a request's KV lives; it owns no pages (pages are owned per engine/allocator.py). A row is
held by exactly one live request between `alloc()` and `free(row)`; freeing a free row raises.
Not thread-safe: one scheduler thread owns the pool.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """`[max_reqs, max_context_len]` int64 slot table plus a free list of rows."""

    def __init__(
        self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu"
    ) -> None:
        if max_reqs <= 0:
            raise ValueError(f"max_reqs: must be positive, got {max_reqs}")
        if max_context_len <= 0:
            raise ValueError(f"max_context_len: must be positive, got {max_context_len}")
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.table = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=self.device)
        self.reset()

    def reset(self) -> None:
        """Mark every row free (only when no request is live)."""
        # Popped from the end, so rows are handed out lowest first.
        self._free_rows = list(range(self.max_reqs - 1, -1, -1))
        self._is_free = [True] * self.max_reqs

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    @property
    def num_used(self) -> int:
        return self.max_reqs - len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when all rows are held."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._is_free[row] = False
        return row

    def free(self, row: int) -> None:
        """Return a row; it must be held (a double free raises)."""
        self._check_row(row)
        if self._is_free[row]:
            raise RuntimeError(f"row: double free of request row {row}")
        self._is_free[row] = True
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record `slots` as the KV slots of tokens [start, start + len(slots)) of `row`."""
        self._check_row(row)
        if self._is_free[row]:
            raise RuntimeError(f"row: write to free request row {row}")
        end = start + slots.numel()
        if start < 0 or end > self.max_context_len:
            raise ValueError(
                f"start: tokens [{start}, {end}) outside max_context_len {self.max_context_len}")
        self.table[row, start:end] = slots.reshape(-1).to(self.device, torch.int64)

    def write_tokens(self, rows: list[int], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """One slot per row: `table[rows[i], positions[i]] = slots[i]` (a decode step's new
        tokens), in one indexed store."""
        self._check_tokens(rows, positions)
        self.table[rows, positions] = slots.reshape(-1).to(self.device, torch.int64)

    def read_tokens(self, rows: list[int], positions: torch.Tensor) -> torch.Tensor:
        """`table[rows[i], positions[i]]` for each i (a copy)."""
        self._check_tokens(rows, positions)
        return self.table[rows, positions]

    def _check_tokens(self, rows: list[int], positions: torch.Tensor) -> None:
        for row in rows:
            self._check_row(row)
            if self._is_free[row]:
                raise RuntimeError(f"row: access to free request row {row}")
        if positions.numel() and (int(positions.min()) < 0
                                  or int(positions.max()) >= self.max_context_len):
            raise ValueError(f"positions: outside max_context_len {self.max_context_len}")

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of tokens [start, end) of `row` (a view into the table)."""
        self._check_row(row)
        if not 0 <= start <= end <= self.max_context_len:
            raise ValueError(
                f"end: range [{start}, {end}) outside max_context_len {self.max_context_len}")
        return self.table[row, start:end]

    def is_free(self, row: int) -> bool:
        self._check_row(row)
        return self._is_free[row]

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_reqs:
            raise ValueError(f"row: {row} outside [0, {self.max_reqs})")
