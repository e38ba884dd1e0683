"""Fused RMSNorm / residual-add, RoPE and SiLU-mul Triton kernels against their torch
references, and a whole model run with them against the plain-torch model.

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

from fixtures.paged import PagedRunner  # noqa: E402
from fixtures.tiny_model import write_tiny_model  # noqa: E402

from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.engine.models.rope import RotaryEmbedding, apply_rope  # noqa: E402
from pdserve.kernels.fused_norm import rmsnorm, rmsnorm_reference  # noqa: E402
from pdserve.kernels.kv_store import store_kv_reference  # noqa: E402
from pdserve.kernels.rope import apply_rope_qk_, apply_rope_store_, rope_reference  # noqa: E402
from pdserve.kernels.silu_mul import silu_mul, silu_mul_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (3, 200), (0, 32)])
def test_rmsnorm_matches_reference(rows: int, hidden: int) -> None:
    x, w = _randn(rows, hidden, seed=0), _randn(hidden, seed=1)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), rmsnorm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rmsnorm_updates_residual(dtype: torch.dtype) -> None:
    x, w = _randn(5, 80, seed=2, dtype=dtype), _randn(80, seed=3, dtype=dtype)
    res = _randn(5, 80, seed=4, dtype=dtype)
    want_out, want_res = rmsnorm_reference(x, w, 1e-5, res.clone())
    out, new_res = rmsnorm(x, w, 1e-5, res)
    assert new_res is res  # updated in place: the residual stream is carried, not copied
    # One rounding of one add, as torch does; the CPU interpreter truncates fp32 -> bf16
    # instead of rounding to nearest, so there it is within one bf16 step.
    exact = dtype == torch.float32 or DEV == "cuda"
    torch.testing.assert_close(res, want_res, atol=0, rtol=0 if exact else 2**-7)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)


def test_rmsnorm_rejects_bad_shapes() -> None:
    x = _randn(2, 8, seed=0)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, _randn(7, seed=1), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rmsnorm(x, _randn(8, seed=1), 1e-6, _randn(3, 8, seed=2))
    with pytest.raises(ValueError, match="x:"):
        rmsnorm(_randn(2, 2, 8, seed=3), _randn(8, seed=1), 1e-6)


@pytest.mark.parametrize("hq,hk,d", [(4, 2, 16), (6, 1, 8), (3, 3, 32)])
def test_rope_matches_reference_and_model_rope(hq: int, hk: int, d: int) -> None:
    t = 9
    qkv = _randn(t, (hq + 2 * hk) * d, seed=5)
    q = qkv[:, :hq * d].view(t, hq, d)  # strided views of a fused projection, as in the model
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    positions = torch.tensor([0, 1, 2, 3, 50, 51, 7, 1000, 4], device=DEV)
    rotary = RotaryEmbedding(d, 10000.0, None, DEV)
    cos, sin = rotary.cos_sin_half(positions)
    want_q, want_k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    full_cos, full_sin = rotary.cos_sin(positions, torch.float32)
    torch.testing.assert_close(want_q, apply_rope(q, full_cos, full_sin))
    v_before = qkv[:, (hq + hk) * d:].clone()
    apply_rope_qk_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)  # v untouched


def test_rope_rejects_mismatch() -> None:
    q, k = _randn(3, 2, 8, seed=0), _randn(3, 1, 8, seed=1)
    with pytest.raises(ValueError, match="cos"):
        apply_rope_qk_(q, k, _randn(3, 8, seed=2), _randn(3, 8, seed=3))
    with pytest.raises(ValueError, match="k:"):
        apply_rope_qk_(q, _randn(2, 1, 8, seed=1), _randn(3, 4, seed=2), _randn(3, 4, seed=3))


@pytest.mark.parametrize("hq,hk,d,page", [(4, 2, 16, 4), (6, 1, 8, 1), (3, 3, 32, 16)])
def test_rope_store_matches_rope_then_store(hq: int, hk: int, d: int, page: int) -> None:
    """q rotated in place, rotated k and v written at their slots of the pool's per-layer
    views, nothing else in the pool touched, k left as it was."""
    t = 5
    qkv = _randn(t, (hq + 2 * hk) * d, seed=8)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    cos, sin = RotaryEmbedding(d, 10000.0, None, DEV).cos_sin_half(
        torch.tensor([3, 0, 17, 900, 4], device=DEV))
    pool = _randn(6, 3, 2, page, hk, d, seed=9)  # [pages, layers, k/v, page, heads, dim]
    want = pool.clone()
    # Distinct slots at every page size (two tokens on one slot would race on the GPU).
    slots = (torch.tensor([2, 1, 5, 3, 0]) * page
             + torch.tensor([0, page // 2, page - 1, 0, page - 1])).to(DEV)
    want_q, want_k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    store_kv_reference(want[:, 1, 0], want[:, 1, 1], slots, want_k, v)
    k_before = k.clone()
    apply_rope_store_(q, k, v, cos, sin, pool[:, 1, 0], pool[:, 1, 1], slots)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(pool, want)
    assert torch.equal(k, k_before)


def test_rope_store_rejects_bad_shapes() -> None:
    q, k, v = _randn(3, 2, 8, seed=0), _randn(3, 1, 8, seed=1), _randn(3, 1, 8, seed=2)
    cos, sin = _randn(3, 4, seed=3), _randn(3, 4, seed=4)
    pool = _randn(4, 2, 4, 1, 8, seed=5)
    slots = torch.tensor([0, 1, 2], device=DEV)
    with pytest.raises(ValueError, match="k / v"):
        apply_rope_store_(q, k, v[:2], cos, sin, pool[:, 0], pool[:, 1], slots)
    with pytest.raises(ValueError, match="k_cache"):
        apply_rope_store_(q, k, v, cos, sin, pool[:, 0, :, :, :4], pool[:, 1, :, :, :4], slots)
    with pytest.raises(ValueError, match="slots"):
        apply_rope_store_(q, k, v, cos, sin, pool[:, 0], pool[:, 1], slots[:2])


@pytest.mark.parametrize("t,n,block", [(1, 40, 16), (6, 100, 32), (0, 8, 16)])
def test_silu_mul_matches_reference(t: int, n: int, block: int) -> None:
    gate_up = _randn(t, 2 * n, seed=6)
    torch.testing.assert_close(silu_mul(gate_up, block=block), silu_mul_reference(gate_up))


@pytest.mark.parametrize("residual_gemm", [True, False])
def test_model_with_fused_ops_matches_plain_torch(tmp_path, residual_gemm: bool) -> None:
    """The tiny Llama through the fused elementwise kernels (forced on, whatever the device)
    gives the logits and greedy tokens of the plain-torch model, with the residual adds in the
    closing projections' GEMMs or in the norms."""
    path = write_tiny_model(tmp_path, "llama", seed=3)
    model, _ = load_model(path, torch.float32, DEV)
    prompt = [5, 17, 99, 3, 250, 41, 7, 8, 120]
    plain_logits = PagedRunner(model, page_size=4).extend({0: prompt})[0]
    plain = PagedRunner(model, page_size=4).greedy(0, prompt, 5)
    with model.fusion.override(on_cpu=True, residual_gemm=residual_gemm, rope_store=False,
                               decode_gemv=False):
        fused_logits = PagedRunner(model, page_size=4).extend({0: prompt})[0]
        torch.testing.assert_close(fused_logits, plain_logits, atol=1e-4, rtol=0)
        assert PagedRunner(model, page_size=4).greedy(0, prompt, 5) == plain


def test_batched_decode_with_fused_ops_matches_plain_torch(tmp_path) -> None:
    """Decode steps of three sequences (RoPE and the KV store in one kernel, attention reading
    K/V from the pool) against the plain-torch model: logits and the pool's contents."""
    model, _ = load_model(write_tiny_model(tmp_path, "llama", seed=6), torch.float32, DEV)
    prompts = {0: [5, 17, 99, 3], 1: [250, 41], 2: [7, 8, 120, 4, 9, 33, 2]}
    plain, fused = PagedRunner(model, page_size=4), PagedRunner(model, page_size=4)
    plain.extend(prompts)
    fused.extend(prompts)
    toks = {0: 11, 1: 12, 2: 13}
    for _ in range(3):
        want = plain.decode(toks)
        with model.fusion.override(on_cpu=True):
            got = fused.decode(toks)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(fused.pool.buffer, plain.pool.buffer, atol=1e-5, rtol=0)
        toks = {s: int(t) for s, t in zip(toks, want.argmax(-1))}
