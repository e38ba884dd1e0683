"""PDSERVE_KERNEL_PROFILE: a scheduler's long extends profiled on file, and their summary."""

from __future__ import annotations

import pytest

from pdserve.bench.kernel_profile import main, read
from pdserve.engine import kernel_profile
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.envs import envs


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_PROFILE", str(tmp_path))
    monkeypatch.setattr(kernel_profile, "MIN_TOKENS", 24)
    envs.cache_clear()
    yield tmp_path
    envs.cache_clear()


def test_long_extends_are_profiled_and_summarized(profile_dir, capsys):
    llm = LLM(model_shape="tiny", device="cpu")
    prof = llm.scheduler.kernels
    before = prof.steps
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(5, 35))], greedy)  # 30 tokens: profiled
    llm.generate([list(range(40, 50))], greedy)  # 10: below MIN_TOKENS, and decode steps
    assert prof.steps == before + 1
    head, steps = read(prof.path)
    assert head["device"] == "cpu"
    last = steps[-1]
    assert last["tokens"] == 30 and last["wall_ms"] > 0
    assert any("mm" in k or "linear" in k for k in last["kernels"])  # the projections ran
    assert last["kernel_ms"] == pytest.approx(sum(last["kernels"].values()), rel=1e-3)
    assert 0 < last["span_ms"] <= last["wall_ms"]
    assert main([str(profile_dir), "--skip", str(len(steps) - 1)]) == 0
    out = capsys.readouterr().out
    assert "span ms" in out and "30" in out


def test_no_profile_without_the_switch(monkeypatch):
    monkeypatch.delenv("PDSERVE_KERNEL_PROFILE", raising=False)
    envs.cache_clear()
    assert LLM(model_shape="tiny", device="cpu").scheduler.kernels is None
    envs.cache_clear()
