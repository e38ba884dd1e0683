"""Our GEMM with fused epilogues (kernels/gemm.py) against its torch reference, and the tiny
Llama's MLP through it against the plain-torch model.

Runs under TRITON_INTERPRET=1 on CPU (set before any kernel module is imported), in fp16: the
interpreter's bf16 `tl.dot` returns garbage (Triton 3.9); compiled on a GPU in bf16 as well.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pdserve.kernels.gemm import (  # noqa: E402
    gemm,
    gemm_reference,
    silu_config,
    supported,
    tail_splits,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config", [
    (5, 48, 64, (16, 32, 32, 2, 1, 4, 2)),
    (33, 96, 200, (16, 32, 32, 2, 3, 4, 2)),  # split-K over 7 K tiles
    (64, 128, 128, (32, 64, 64, 1, 2, 4, 2)),
    (70, 256, 96, None),  # the defaults
])
@pytest.mark.parametrize("silu,res", [(False, False), (True, False), (False, True),
                                      (True, True)])
def test_gemm_matches_reference(dtype, m: int, n: int, k: int, config, silu: bool,
                                res: bool) -> None:
    """With silu_mul, w is a fused [gate; up] of n rows and the output has n / 2."""
    x = _randn(m, k, seed=m + k, dtype=dtype)
    w = _randn(n, k, seed=1, dtype=dtype) / k**0.5
    r = _randn(m, n // 2 if silu else n, seed=2, dtype=dtype) if res else None
    got = gemm(x, w, silu_mul=silu, residual=r, config=config)
    want = gemm_reference(x, w, silu_mul=silu, residual=r)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu,res", [(False, False), (True, False), (False, True),
                                      (True, True)])
def test_gemm_split_last_wave_matches_reference(dtype, silu: bool, res: bool) -> None:
    """With 9 programs at once, the tiles of the last wave (2 of 20 with SiLU-mul, 4 of 40
    without) are split over K into 4 / 2 partial sums; the result is the reference's."""
    m, n, k, config = 70, 256, 512, (16, 32, 32, 2, 1, 4, 2)
    assert tail_splits(20 if silu else 40, 9, 16) == (4 if silu else 2)
    x = _randn(m, k, seed=11, dtype=dtype)
    w = _randn(n, k, seed=12, dtype=dtype) / k**0.5
    r = _randn(m, n // 2 if silu else n, seed=13, dtype=dtype) if res else None
    got = gemm(x, w, silu_mul=silu, residual=r, config=config, sms=9)
    want = gemm_reference(x, w, silu_mul=silu, residual=r)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_tail_splits() -> None:
    """A 4096-token prefill's gate_up (3584 tiles of 128 x 128 on 132 SMs): the 20 tiles of
    the last wave split 6 ways; no split for whole waves, one partial wave, or too little room."""
    assert tail_splits(3584, 132, 64) == 6
    assert tail_splits(27 * 132, 132, 64) == 1
    assert tail_splits(100, 132, 64) == 1
    assert tail_splits(224, 132, 64) == 1  # 92 left over: no room to split them
    assert tail_splits(3584, 132, 8) == 2  # each split keeps >= 4 K tiles
    assert tail_splits(3584, 0, 64) == 1


def test_gemm_writes_into_out() -> None:
    x = _randn(8, 32, seed=3, dtype=torch.float16)
    w = _randn(64, 32, seed=4, dtype=torch.float16)
    out = torch.full((8, 32), 7.0, device=DEV, dtype=torch.float16)
    assert gemm(x, w, silu_mul=True, out=out, config=(16, 16, 16, 1, 1, 4, 2)) is out
    torch.testing.assert_close(out, gemm_reference(x, w, silu_mul=True), atol=2e-3, rtol=2e-3)


def test_gemm_rejects_bad_shapes() -> None:
    x = _randn(4, 32, seed=5, dtype=torch.float16)
    with pytest.raises(ValueError, match="do not chain"):
        gemm(x, _randn(16, 48, seed=6, dtype=torch.float16))
    with pytest.raises(ValueError, match="even number of rows"):
        gemm(x, _randn(15, 32, seed=6, dtype=torch.float16), silu_mul=True)
    with pytest.raises(ValueError, match="residual"):
        gemm(x, _randn(16, 32, seed=6, dtype=torch.float16),
             residual=_randn(4, 8, seed=7, dtype=torch.float16))
    with pytest.raises(ValueError, match="K-contiguous"):
        gemm(x, _randn(32, 16, seed=6, dtype=torch.float16).t())


def test_silu_config_by_rows_and_devices() -> None:
    assert silu_config(64)[:2] == (64, 64)
    assert silu_config(65)[:2] == (128, 128)
    assert not supported(torch.device("cpu"))  # the engine keeps torch ops there


def test_mlp_through_gemm_matches_plain_torch(tmp_path, monkeypatch) -> None:
    """The tiny Llama's prefill with the MLP's gate_up + SiLU-mul through `gemm` (forced on,
    whatever the device) gives the plain-torch logits and greedy token, in fp16."""
    from fixtures.paged import PagedRunner
    from fixtures.tiny_model import write_tiny_model

    from pdserve.engine.loader import load_model
    from pdserve.engine.models import fused

    model, _ = load_model(write_tiny_model(tmp_path, "llama", seed=5), torch.float16, DEV)
    prompt = [(7 * i + 3) % 250 for i in range(24)]
    kern = fused.kernels()
    calls = []
    monkeypatch.setattr(kern, "gemm", lambda *a, **kw: calls.append(1) or gemm(*a, **kw))
    monkeypatch.setattr(model.fusion, "use_gemm_silu", lambda x, w: x.dim() == 2)
    got = PagedRunner(model, page_size=4).extend({1: prompt})
    assert len(calls) == len(model.layers)
    monkeypatch.setattr(model.fusion, "use_gemm_silu", lambda x, w: False)
    want = PagedRunner(model, page_size=4).extend({1: prompt})
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert int(got.argmax()) == int(want.argmax())


@pytest.mark.skipif(DEV != "cuda", reason="needs a GPU")
def test_mlp_takes_the_gemm_on_a_hopper_gpu() -> None:
    """The engine's choice on the GPU: 64+ bf16 rows take the fused GEMM on Hopper and later,
    fewer rows or the switch off do not."""
    from pdserve.engine.models.fused import Fusion

    hopper = torch.cuda.get_device_capability()[0] >= 9
    fusion = Fusion()
    w = _randn(256, 128, seed=8, dtype=torch.bfloat16)
    assert fusion.use_gemm_silu(_randn(64, 128, seed=9, dtype=torch.bfloat16), w) == hopper
    assert not fusion.use_gemm_silu(_randn(63, 128, seed=9, dtype=torch.bfloat16), w)
    with fusion.override(gemm_silu=False):
        assert not fusion.use_gemm_silu(_randn(64, 128, seed=9, dtype=torch.bfloat16), w)
