"""oneDNN-packed decode linears: same results as F.linear to fp32 rounding, and a packed model
gives the logits and greedy tokens of the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fixtures.paged import PagedRunner
from fixtures.tiny_model import write_tiny_model

from pdserve.engine.cpu_linear import (
    PackedLinearWeight,
    bucket_rows,
    pack_linear_weights,
    packed_linear_supported,
    row_buckets,
)
from pdserve.engine.loader import load_model

pytestmark = pytest.mark.skipif(not packed_linear_supported(), reason="no oneDNN in this torch")


@pytest.mark.parametrize("rows", [1, 3, 8, 32, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_small_batches_use_the_packed_copy(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 72, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    x = torch.randn(rows, 72, generator=g)
    pw = PackedLinearWeight(w, max_rows=128)
    with torch.inference_mode():
        got = F.linear(x, pw, b)
    assert type(got) is torch.Tensor and pw.packed is not None
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_large_batches_and_other_uses_see_the_plain_weight() -> None:
    w = torch.randn(64, 16)
    pw = PackedLinearWeight(w, max_rows=8)
    x = torch.randn(9, 16)
    assert torch.equal(F.linear(x, pw), F.linear(x, w))  # past max_rows: F.linear itself
    assert pw.packed is None  # never used for a small batch: never packed
    ids = torch.tensor([3, 0, 63])
    emb = F.embedding(ids, pw)
    assert type(emb) is torch.Tensor and torch.equal(emb, w[ids])
    assert type(pw[1:3]) is torch.Tensor and torch.equal(pw.t(), w.t())


def test_row_buckets_are_few_and_tight() -> None:
    assert row_buckets(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    for rows in range(1, 129):
        assert rows <= bucket_rows(rows) <= max(2 * rows - 1, rows + 15)


def test_rejects_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="weight"):
        PackedLinearWeight(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight"):
        PackedLinearWeight(torch.randn(4))


@pytest.mark.parametrize("tie", [True, False])
def test_packed_model_matches_plain(tmp_path, tie: bool) -> None:
    path = write_tiny_model(tmp_path, "qwen2", seed=3, tie_word_embeddings=tie)
    plain, _ = load_model(path, torch.float32, "cpu")
    packed, _ = load_model(path, torch.float32, "cpu")
    names = pack_linear_weights(packed)
    assert "layers.0.self_attn.qkv_proj" in names and "lm_head" in names
    assert (packed.lm_head is packed.embed_tokens) == tie
    prompt = [5, 17, 99, 3, 250, 41, 7]
    a, b = PagedRunner(plain), PagedRunner(packed)
    torch.testing.assert_close(b.extend({0: prompt}), a.extend({0: prompt}), atol=1e-4, rtol=0)
    for tok in (11, 12, 13):
        torch.testing.assert_close(b.decode({0: tok}), a.decode({0: tok}), atol=1e-4, rtol=0)
    assert PagedRunner(packed).greedy(0, prompt, 8) == PagedRunner(plain).greedy(0, prompt, 8)
