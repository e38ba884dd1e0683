"""CPU-checkable parts of the GPU attention backends: FlashInfer page tables from token slots,
the Triton backend against the torch reference (interpreter), backend selection."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.engine.attention.flashinfer_backend import page_tables
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.model_runner import default_attention_backend

PAGE, LAYERS = 4, 2


def _batch(prefix_lens: list[int], extend_lens: list[int], kv_heads: int, d: int,
           backend, seed: int = 0) -> tuple[ForwardBatch, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_seq = [-(-n // PAGE) for n in seq_lens]
    pool = KVPool(1 + sum(pages_per_seq) + 2, LAYERS, PAGE, kv_heads, d, torch.float32)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g))
    perm = (torch.randperm(sum(pages_per_seq) + 2, generator=g) + 1).tolist()
    pages, slots, used = [], [], 0
    for n, np_ in zip(seq_lens, pages_per_seq):
        pages.append(perm[used:used + np_])
        used += np_
        pos = torch.arange(n)
        slots.append(torch.tensor(pages[-1], dtype=torch.int64)[pos // PAGE] * PAGE + pos % PAGE)
    mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
    fb = ForwardBatch(
        mode=mode, input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)]),
        out_cache_loc=torch.cat([sl[p:] for sl, p in zip(slots, prefix_lens)]),
        seq_lens=torch.tensor(seq_lens), prefix_lens=torch.tensor(prefix_lens),
        extend_lens=torch.tensor(extend_lens),
        kv_indptr=torch.tensor([0, *torch.cumsum(torch.tensor(seq_lens), 0).tolist()]),
        kv_indices=torch.cat(slots), kv_pool=pool, attn_backend=backend,
        seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens)
    return fb, pages


def test_flashinfer_page_tables_from_token_slots() -> None:
    fb, pages = _batch([0, 5, 12, 3], [1, 3, 4, 1], 2, 8, None)
    indptr, indices, last = page_tables(fb, torch.device("cpu"))
    assert indptr.tolist() == [0, *torch.cumsum(torch.tensor([len(p) for p in pages]), 0)]
    assert indices.tolist() == [p for ps in pages for p in ps]
    assert last.tolist() == [1, 4, 4, 4]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


# The third case is a decode batch large enough (17 x 2 KV heads >= 8 x the interpreter's 4
# "SMs") for the work-list kernel; the second takes the split-KV kernel.
@pytest.mark.parametrize("prefix,extend", [([0, 5, 12], [7, 1, 9]), ([3, 9, 0, 17], [1] * 4),
                                           ([3, 9, 0, 17, 5, 1, 30, 2, 8, 11, 4, 6, 13, 7, 19,
                                             2, 90], [1] * 17)])
def test_triton_backend_matches_torch(prefix: list[int], extend: list[int]) -> None:
    pytest.importorskip("triton")
    from pdserve.engine.attention.triton_backend import TritonAttentionBackend

    heads, kv_heads, d = 4, 2, 16
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        fb, _ = _batch(prefix, extend, kv_heads, d, backend, seed=3)
        backend.init_forward(fb)
        g = torch.Generator().manual_seed(4)
        per_layer = []
        for layer in range(LAYERS):
            q = torch.randn(fb.num_tokens, heads, d, generator=g)
            k = torch.randn(fb.num_tokens, kv_heads, d, generator=g)
            v = torch.randn(fb.num_tokens, kv_heads, d, generator=g)
            per_layer.append(backend.forward(layer, q, k, v, fb, d**-0.5))
        outs.append((torch.stack(per_layer), fb.kv_pool.buffer.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-5, rtol=2e-5)
    assert torch.equal(outs[1][1], outs[0][1])  # identical KV stores


def test_default_backend_selection_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert isinstance(default_attention_backend(cpu), TorchAttentionBackend)
    with pytest.raises(ValueError, match="attention_backend"):
        default_attention_backend(cpu, "triton")
    with pytest.raises(ValueError, match="attention_backend"):
        default_attention_backend(cpu, "nope")


def test_decode_kernel_routing_by_batch_size() -> None:
    """The flashinfer backend's decode batches: Triton's split-KV kernel up to 8 sequences,
    FlashInfer's decode in between, the work list from 8 (sequence x KV head) programs per SM
    (routing only: FlashInfer itself is not needed to decide)."""
    from pdserve.engine.attention import flashinfer_backend as fib
    from pdserve.kernels import decode_worklist
    from pdserve.kernels.device import num_sms

    pytest.importorskip("triton")
    from pdserve.engine.attention.triton_backend import TritonAttentionBackend

    backend = object.__new__(fib.FlashInferAttentionBackend)
    backend._triton_decode = TritonAttentionBackend()  # the interpreter's stand-in: 4 SMs
    backend.flashinfer_decode_only = False
    sms = num_sms(torch.device("cpu"))
    assert [backend.triton_decodes(b, 2) for b in (1, 8, 9, 15, 16, 64)] == [
        True, True, False, False, True, True]
    assert not decode_worklist.uses_worklist(15, 2, sms)
    assert decode_worklist.uses_worklist(16, 2, sms)
    backend.flashinfer_decode_only = True
    assert not any(backend.triton_decodes(b, 2) for b in (1, 8, 16, 64))
    assert decode_worklist.worklist_config(256) == {"target_items": 272, "block_n": 128,
                                                    "num_stages": 2}
