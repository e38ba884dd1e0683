"""ReqToTokenPool: rows handed out once, double free raises, writes stay in bounds."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.req_to_token import ReqToTokenPool


def test_alloc_all_rows_then_none() -> None:
    pool = ReqToTokenPool(3, 16)
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and pool.num_free == 0
    assert pool.alloc() is None
    pool.free(1)
    assert pool.num_free == 1 and pool.alloc() == 1


def test_double_free_and_bad_rows_raise() -> None:
    pool = ReqToTokenPool(2, 8)
    row = pool.alloc()
    assert row is not None
    pool.free(row)
    with pytest.raises(RuntimeError, match=f"row.*{row}"):
        pool.free(row)
    with pytest.raises(ValueError, match="row"):
        pool.free(5)
    with pytest.raises(RuntimeError, match="free request row"):
        pool.write(row, 0, torch.tensor([1]))


def test_write_read_and_bounds() -> None:
    pool = ReqToTokenPool(2, 8)
    row = pool.alloc()
    assert row is not None
    pool.write(row, 0, torch.tensor([4, 5, 6]))
    pool.write(row, 3, torch.tensor([12], dtype=torch.int32))
    assert pool.read(row, 0, 4).tolist() == [4, 5, 6, 12]
    assert pool.table.dtype == torch.int64 and pool.table.shape == (2, 8)
    with pytest.raises(ValueError, match="start"):
        pool.write(row, 6, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="end"):
        pool.read(row, 0, 9)
    with pytest.raises(ValueError, match="max_reqs"):
        ReqToTokenPool(0, 8)


def test_random_alloc_free_keeps_rows_unique() -> None:
    rng = random.Random(0)
    pool = ReqToTokenPool(8, 4)
    held: set[int] = set()
    for _ in range(500):
        if held and rng.random() < 0.5:
            row = rng.choice(sorted(held))
            pool.free(row)
            held.remove(row)
        else:
            row = pool.alloc()
            if row is None:
                assert len(held) == 8
            else:
                assert row not in held
                held.add(row)
        assert pool.num_free + len(held) == 8
        assert all(not pool.is_free(r) for r in held)


def test_write_and_read_tokens_one_per_row() -> None:
    """The batched forms (a decode step's slots) match per-row writes and reads, and refuse
    free rows and positions outside the table."""
    pool = ReqToTokenPool(4, 8)
    rows = [pool.alloc() for _ in range(3)]
    pos = torch.tensor([0, 5, 7])
    pool.write_tokens(rows, pos, torch.tensor([10, 11, 12], dtype=torch.int32))
    assert [pool.read(r, p, p + 1).item() for r, p in zip(rows, pos.tolist())] == [10, 11, 12]
    assert pool.read_tokens(rows, pos).tolist() == [10, 11, 12]
    with pytest.raises(ValueError, match="positions"):
        pool.write_tokens(rows, torch.tensor([0, 1, 8]), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="positions"):
        pool.read_tokens(rows, torch.tensor([-1, 0, 0]))
    pool.free(rows[1])
    with pytest.raises(RuntimeError, match="free request row"):
        pool.read_tokens(rows, pos)
