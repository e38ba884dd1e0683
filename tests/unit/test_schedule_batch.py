"""ScheduleBatch.build: the decode fast path (one masked gather over the request-to-token
rows) gives the same tensors as the general per-request slices of an extend batch."""

from __future__ import annotations

import torch

from pdserve.engine.forward_batch import ForwardMode
from pdserve.engine.req import Req
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.schedule_batch import ExtendEntry, ScheduleBatch


def test_decode_build_matches_per_request_slices() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 10_000, (8, 64), generator=gen)
    reqs = []
    for i, (n_in, n_out, row) in enumerate([(5, 3, 6), (17, 0, 1), (1, 30, 3), (40, 9, 0)]):
        r = Req(f"r{i}", list(range(100, 100 + n_in)), SamplingParams(max_tokens=64))
        r.output_ids = list(range(200, 200 + n_out))
        r.req_pool_idx = row
        reqs.append(r)
    fb = ScheduleBatch(ForwardMode.DECODE, reqs).build(table, None, None, torch.device("cpu"))
    # The same tokens as an extend batch of one token per request (the general path).
    entries = [ExtendEntry(r, r.seq_len - 1, 1) for r in reqs]
    ref = ScheduleBatch(ForwardMode.EXTEND, reqs, entries).build(table, None, None,
                                                                torch.device("cpu"))
    for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "prefix_lens",
                 "extend_lens", "kv_indptr", "kv_indices"):
        assert torch.equal(getattr(fb, name), getattr(ref, name)), name
    assert fb.kv_indices[:8].tolist() == table[6, :8].tolist()
    assert fb.out_cache_loc.tolist() == [int(table[r.req_pool_idx, r.seq_len - 1]) for r in reqs]
    assert fb.seq_lens_cpu == [r.seq_len for r in reqs] and fb.extend_lens_cpu == [1] * 4


def test_decode_build_of_no_requests() -> None:
    fb = ScheduleBatch(ForwardMode.DECODE, []).build(torch.zeros(2, 4, dtype=torch.int64), None,
                                                     None, torch.device("cpu"))
    assert fb.batch_size == 0 and fb.kv_indices.numel() == 0 and fb.kv_indptr.tolist() == [0]
