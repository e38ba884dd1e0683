"""The router's and the worker's token-id checks (fast paths over min/max) name the same bad
ids as a plain scan, on fresh random inputs."""

from __future__ import annotations

import random

import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.prepare import _bad_ids
from pdserve.worker.validate import BadRequest, validate_request

VOCAB = 1000


def _reference(ids: list, vocab: int) -> list:
    return [t for t in ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]


def _entry(rng: random.Random):
    roll = rng.random()
    if roll < 0.9:
        return rng.randrange(VOCAB)
    return rng.choice([-1, VOCAB, VOCAB + 7, 2 ** 70, -(2 ** 70), True, False, 3.0, "7", None])


@pytest.mark.parametrize("seed", range(200))
def test_router_check_names_what_a_scan_names(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice([1, 2, 5, 64, 2048])
    ids = [_entry(rng) if rng.random() < 0.05 else rng.randrange(VOCAB) for _ in range(n)]
    if seed % 4 == 0:
        ids = [rng.randrange(VOCAB) for _ in range(n)]  # the common case: all good
    assert _bad_ids(ids, VOCAB) == _reference(ids, VOCAB)


@pytest.mark.parametrize("seed", range(100))
def test_worker_check_refuses_what_a_scan_refuses(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice([1, 3, 256, 2048])
    ids = [rng.randrange(VOCAB) for _ in range(n)]
    for _ in range(rng.choice([0, 0, 1, 3])):
        ids[rng.randrange(n)] = rng.choice([-1, -(2 ** 31), VOCAB, VOCAB + 1, 2 ** 31 - 1])
    req = pb.DecodeRequest(request_id="r", input_ids=ids)
    bad = _reference(ids, VOCAB)
    if not bad:
        valid = validate_request(req, VOCAB, 1 << 20, None)
        assert valid.input_ids == ids and type(valid.input_ids) is list
        return
    with pytest.raises(BadRequest, match=f"token id {bad[0]} outside the vocabulary"):
        validate_request(req, VOCAB, 1 << 20, None)
