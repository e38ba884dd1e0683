"""TorchAttentionBackend against a naive per-sequence causal attention over dense K/V."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.attention import cpu_decode
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.cpu_extension import build_or_load
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
         seed: int, cpu_kernel: bool = False) -> None:
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
    backend = TorchAttentionBackend(cpu_kernel=cpu_kernel)
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
    # The C++ decode kernel runs exactly when asked for and the batch is a decode batch.
    assert (backend._paged is not None) == (cpu_kernel and mode == ForwardMode.DECODE)
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


@pytest.fixture(scope="module")
def cpu_kernel() -> bool:
    if cpu_decode.load(block=True) is None:
        pytest.skip("the C++ decode kernel could not be built here")
    return True


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_decode(heads: int, kv_heads: int) -> None:
    _run([0, 12, 3, 7], [1, 1, 1, 1], heads, kv_heads, seed=1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1), (9, 3)])
def test_decode_cpu_kernel(heads: int, kv_heads: int, cpu_kernel: bool) -> None:
    _run([0, 12, 3, 7, 40], [1, 1, 1, 1, 1], heads, kv_heads, seed=2, cpu_kernel=cpu_kernel)


def test_cpu_kernel_matches_torch_path_on_long_sequences(cpu_kernel: bool) -> None:
    """Kernel vs the torch reference (not the naive one) at a realistic size: equal to fp32
    rounding, and the KV it stores is bit-identical."""
    g = torch.Generator().manual_seed(3)
    lens, kvh, heads, d, page = [1, 15, 16, 17, 200, 333], 3, 9, 64, 16
    pages = [-(-n // page) for n in lens]
    pools = [KVPool(1 + sum(pages), 1, page, kvh, d, torch.float32) for _ in range(2)]
    perm = (torch.randperm(sum(pages), generator=g) + 1).split(pages)
    slots = [p[torch.arange(n) // page] * page + torch.arange(n) % page
             for p, n in zip(perm, lens)]
    for pool in pools:
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator()
                                      .manual_seed(4)))
    q = torch.randn(len(lens), heads, d, generator=g)
    k, v = torch.randn(2, len(lens), kvh, d, generator=g)
    outs = []
    for pool, kernel in zip(pools, (False, True)):
        backend = TorchAttentionBackend(cpu_kernel=kernel)
        fb = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=torch.zeros(len(lens), dtype=torch.int64),
            positions=torch.tensor(lens) - 1, out_cache_loc=torch.stack([s[-1] for s in slots]),
            seq_lens=torch.tensor(lens), prefix_lens=torch.tensor(lens) - 1,
            extend_lens=torch.ones(len(lens), dtype=torch.int64),
            kv_indptr=torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()]),
            kv_indices=torch.cat(slots), kv_pool=pool, attn_backend=backend, seq_lens_cpu=lens)
        backend.init_forward(fb)
        outs.append(backend.forward(0, q, k, v, fb, d**-0.5))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-6, rtol=1e-5)
    assert torch.equal(pools[0].buffer, pools[1].buffer)


def test_cpu_kernel_falls_back_when_slots_leave_page_order(cpu_kernel: bool) -> None:
    pool = KVPool(4, 1, 4, 1, 8, torch.float32)
    backend = TorchAttentionBackend(cpu_kernel=cpu_kernel)
    slots = torch.tensor([4, 5, 7, 6])  # within one page, but not in position order
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(1, dtype=torch.int64),
        positions=torch.tensor([3]), out_cache_loc=slots[-1:], seq_lens=torch.tensor([4]),
        prefix_lens=torch.tensor([3]), extend_lens=torch.tensor([1]),
        kv_indptr=torch.tensor([0, 4]), kv_indices=slots, kv_pool=pool, attn_backend=backend)
    backend.init_forward(fb)
    assert backend._paged is None


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 13), st.integers(1, 9)), min_size=1, max_size=4),
       st.sampled_from([(2, 1), (4, 2), (3, 3)]), st.integers(0, 2**16))
def test_random_batches(seqs: list[tuple[int, int]], heads: tuple[int, int], seed: int) -> None:
    _run([p for p, _ in seqs], [e for _, e in seqs], *heads, seed=seed)


def test_kernel_build_is_cached_without_locks(cpu_kernel: bool) -> None:
    """Another process loads the cached library itself without building (not a build
    directory's copy, which is gone), and the cache holds no lock file that a killed process
    could leave behind."""
    here = build_or_load("pdserve_cpu_decode", cpu_decode._SOURCE, ["paged_decode"])
    root = os.path.dirname(here.__file__)
    assert os.path.basename(root) == "cpu_ext" and os.path.isfile(here.__file__)
    code = ("import sys; from unittest import mock; from pdserve.engine.attention import "
            "cpu_decode; from pdserve.engine.cpu_extension import build_or_load\n"
            "with mock.patch('torch.utils.cpp_extension.load_inline', side_effect=AssertionError"
            "('built again')):\n"
            "    m = build_or_load('pdserve_cpu_decode', cpu_decode._SOURCE, ['paged_decode'])\n"
            "print(m.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == here.__file__, out.stderr[-2000:]
    assert "lock" not in os.listdir(root)
    assert not [f for f in os.listdir(root) if not f.endswith(".so")]  # no build directory
