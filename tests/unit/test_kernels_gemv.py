"""The one-token decode GEMV kernels (kernels/gemv.py) against their torch references, and the
tiny Llama's batch-1 decode through them against the plain-torch model.

Runs under TRITON_INTERPRET=1 on CPU (set before any kernel module is imported); compiled on a
GPU when there is one.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pdserve.kernels.gemv import (  # noqa: E402
    gemv,
    gemv_reference,
    qkv_rope_store,
    qkv_rope_store_reference,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


@pytest.mark.parametrize("n,k,blocks", [(96, 64, (16, 32, 4)), (50, 200, (8, 64, 2)),
                                        (33, 48, None), (7, 300, (4, 128, 4))])
@pytest.mark.parametrize("norm,silu,res", [(False, False, False), (True, False, False),
                                           (False, False, True), (True, True, False),
                                           (False, True, True)])
def test_gemv_matches_reference(n: int, k: int, blocks, norm: bool, silu: bool,
                                res: bool) -> None:
    """With silu_mul, w is a fused [gate; up] of 2n rows and the output has n."""
    x = _randn(1, k, seed=n + k)
    w = _randn(2 * n if silu else n, k, seed=1) / k**0.5
    g = _randn(k, seed=2) if norm else None
    r = _randn(1, n, seed=3) if res else None
    kw = {"norm_weight": g, "eps": 1e-5, "silu_mul": silu, "residual": r}
    torch.testing.assert_close(gemv(x, w, blocks=blocks, **kw), gemv_reference(x, w, **kw),
                               atol=1e-4, rtol=1e-4)


def test_gemv_column_major_weight_and_bf16_fp32_out() -> None:
    x = _randn(1, 128, seed=4, dtype=torch.bfloat16)
    w = _randn(64, 128, seed=5, dtype=torch.bfloat16)
    g = _randn(128, seed=6, dtype=torch.bfloat16)
    want = gemv_reference(x, w, norm_weight=g, eps=1e-6, out_dtype=torch.float32)
    for weight in (w, w.t().contiguous().t()):
        got = gemv(x, weight, norm_weight=g, eps=1e-6, out_dtype=torch.float32)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_gemv_rejects_bad_shapes() -> None:
    w = _randn(8, 16, seed=0)
    with pytest.raises(ValueError, match="x: expected"):
        gemv(_randn(2, 16, seed=1), w)
    with pytest.raises(ValueError, match="N even"):
        gemv(_randn(1, 16, seed=1), w[:7], silu_mul=True)
    with pytest.raises(ValueError, match="residual"):
        gemv(_randn(1, 16, seed=1), w, silu_mul=True, residual=_randn(1, 8, seed=2))
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(_randn(1, 16, seed=1), w, norm_weight=_randn(8, seed=2))
    with pytest.raises(ValueError, match="residual"):
        gemv(_randn(1, 16, seed=1), w, residual=_randn(1, 16, seed=2))


def _pool(pages: int, ps: int, hk: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    """K and V views of one page-major buffer [P, 2, ps, hk, d], as engine/kv_pool.py lays out
    a layer (strided: K and V of a page interleave)."""
    buf = _randn(pages, 2, ps, hk, d, seed=seed)
    return buf, buf[:, 0], buf[:, 1]


@pytest.mark.parametrize("hq,hk,d,k,bias,blocks", [
    (4, 2, 16, 64, False, (8, 32, 4)), (6, 2, 32, 96, True, (4, 32, 2)),
    (2, 1, 8, 40, False, None)])
def test_qkv_rope_store_matches_reference(hq: int, hk: int, d: int, k: int, bias: bool,
                                          blocks) -> None:
    rows = (hq + 2 * hk) * d
    x, w, g = _randn(1, k, seed=7), _randn(rows, k, seed=8) / k**0.5, _randn(k, seed=9)
    b = _randn(rows, seed=10) if bias else None
    angle = _randn(1, d // 2, seed=11) * 3
    cos, sin = angle.cos(), angle.sin()
    slot = torch.tensor([13], device=DEV)  # page 3, offset 1 of 4-token pages
    buf, kc, vc = _pool(6, 4, hk, d, seed=12)
    ref_buf, ref_kc, ref_vc = _pool(6, 4, hk, d, seed=12)
    args = (b, g, 1e-5, cos, sin)
    q = qkv_rope_store(x, w, *args, kc, vc, slot, hq, hk, blocks=blocks)
    want_q = qkv_rope_store_reference(x, w, *args, ref_kc, ref_vc, slot, hq, hk)
    torch.testing.assert_close(q, want_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(buf, ref_buf, atol=1e-4, rtol=1e-4)  # only slot 13 changed
    assert not torch.equal(buf[3, :, 1], _pool(6, 4, hk, d, seed=12)[0][3, :, 1])


def test_qkv_rope_store_rejects_bad_shapes() -> None:
    _, kc, vc = _pool(2, 4, 2, 8, seed=0)
    x, g = _randn(1, 16, seed=1), _randn(16, seed=2)
    cos = sin = torch.zeros(1, 4, device=DEV)
    slot = torch.tensor([1], device=DEV)
    with pytest.raises(ValueError, match="w: expected"):
        qkv_rope_store(x, _randn(40, 16, seed=3), None, g, 1e-5, cos, sin, kc, vc, slot, 4, 2)
    w = _randn(64, 16, seed=3)
    with pytest.raises(ValueError, match="cos"):
        qkv_rope_store(x, w, None, g, 1e-5, cos[:, :2], sin, kc, vc, slot, 4, 2)
    with pytest.raises(ValueError, match="slot"):
        qkv_rope_store(x, w, None, g, 1e-5, cos, sin, kc, vc, slot.repeat(2), 4, 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: qkv bias, tied embeddings
def test_batch1_decode_through_gemv_matches_plain_torch(tmp_path, monkeypatch, arch) -> None:
    """The tiny model's one-token decode steps through the fused GEMV kernels (forced on,
    whatever the device) give the plain-torch logits and greedy tokens."""
    from fixtures.paged import PagedRunner
    from fixtures.tiny_model import write_tiny_model

    from pdserve.engine.loader import load_model
    from pdserve.engine.models import decode_gemv

    model, _ = load_model(write_tiny_model(tmp_path, arch, seed=4), torch.float32, DEV)
    prompt = [5, 17, 99, 3, 250, 41, 7]
    plain, fused = PagedRunner(model, page_size=4), PagedRunner(model, page_size=4)
    plain.extend({1: prompt})
    fused.extend({1: prompt})
    calls = []
    real_forward = decode_gemv.forward
    monkeypatch.setattr(decode_gemv, "forward",
                        lambda m, fb: calls.append(1) or real_forward(m, fb))
    tok = 11
    for _ in range(4):
        with model.fusion.override(on_cpu=True):
            got = fused.decode({1: tok})[0]
        with model.fusion.override(decode_gemv=False):
            want = plain.decode({1: tok})[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fused.pool.buffer, plain.pool.buffer, atol=1e-5, rtol=1e-5)
        tok = int(want.argmax())
        assert int(got.argmax()) == tok
    assert len(calls) == 4
    with model.fusion.override(on_cpu=True):
        plain.decode({1: tok, 2: 3})  # two tokens: not this path
    assert len(calls) == 4
