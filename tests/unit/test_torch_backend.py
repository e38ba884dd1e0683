"""TorchAttentionBackend against a naive per-sequence causal attention over dense K/V."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.kv_pool import KVPool

LAYERS, PAGE = 2, 4


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float):
    """q [n, h, d] at positions prefix.., k/v [prefix + n, kvh, d] -> [n, h, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(q.shape[0])[:, None] + prefix
    scores = scores.masked_fill(torch.arange(k.shape[0])[None] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run(prefix_lens: list[int], extend_lens: list[int], heads: int, kv_heads: int,
         seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    d, b = 8, len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_seq = -(-max(seq_lens) // PAGE)
    pool = KVPool(1 + b * pages_per_seq, LAYERS, PAGE, kv_heads, d, torch.float32)
    # Shuffled pages per sequence: the backend must not assume any page order.
    perm = (torch.randperm(b * pages_per_seq, generator=g) + 1).view(b, pages_per_seq)
    slots = [perm[i][torch.arange(n) // PAGE] * PAGE + torch.arange(n) % PAGE
             for i, n in enumerate(seq_lens)]
    full_k = [torch.randn(n, kv_heads, d, generator=g) for n in seq_lens]
    full_v = [torch.randn(n, kv_heads, d, generator=g) for n in seq_lens]
    for layer in range(LAYERS):
        for i, p in enumerate(prefix_lens):  # the cached prefix is already in the pool
            pool.set_kv(layer, slots[i][:p], full_k[i][:p] * (layer + 1), full_v[i][:p])
    q = [torch.randn(e, heads, d, generator=g) for e in extend_lens]
    mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
    backend = TorchAttentionBackend()
    fb = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)]),
        out_cache_loc=torch.cat([sl[p:] for sl, p in zip(slots, prefix_lens)]),
        seq_lens=torch.tensor(seq_lens), prefix_lens=torch.tensor(prefix_lens),
        extend_lens=torch.tensor(extend_lens),
        kv_indptr=torch.tensor([0, *torch.cumsum(torch.tensor(seq_lens), 0).tolist()]),
        kv_indices=torch.cat(slots), kv_pool=pool, attn_backend=backend,
    )
    backend.init_forward(fb)
    scale = d**-0.5
    for layer in range(LAYERS):
        new_k = torch.cat([k[p:] * (layer + 1) for k, p in zip(full_k, prefix_lens)])
        new_v = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens)])
        out = backend.forward(layer, torch.cat(q), new_k, new_v, fb, scale)
        want = torch.cat([_naive(qi, k * (layer + 1), v, p, scale)
                          for qi, k, v, p in zip(q, full_k, full_v, prefix_lens)])
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_extend_mixed_prefixes(heads: int, kv_heads: int) -> None:
    _run([0, 5, 3], [7, 1, 9], heads, kv_heads, seed=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_decode(heads: int, kv_heads: int) -> None:
    _run([0, 12, 3, 7], [1, 1, 1, 1], heads, kv_heads, seed=1)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 13), st.integers(1, 9)), min_size=1, max_size=4),
       st.sampled_from([(2, 1), (4, 2), (3, 3)]), st.integers(0, 2**16))
def test_random_batches(seqs: list[tuple[int, int]], heads: tuple[int, int], seed: int) -> None:
    _run([p for p, _ in seqs], [e for _, e in seqs], *heads, seed=seed)
