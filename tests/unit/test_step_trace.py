"""PDSERVE_STEP_TRACE: the offline engine's steps on file, and their summary per window."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.step_trace import Window, main, read_trace, summarize
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.envs import envs


@pytest.fixture
def trace_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_STEP_TRACE", str(tmp_path))
    envs.cache_clear()
    yield tmp_path
    envs.cache_clear()


def test_offline_steps_are_written_and_summarized(trace_dir, capsys):
    llm = LLM(model_shape="tiny", device="cpu")
    prompts = [[5 + i, 6, 7, 8, 9][: 2 + i] for i in range(3)]  # 2, 3 and 4 tokens
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    llm.scheduler.trace.flush()
    head, rows = read_trace(llm.scheduler.trace.path)
    assert head["argv"]
    ext = [r for r in rows if r["mode"] == "extend"]
    dec = [r for r in rows if r["mode"] == "decode"]
    # The engine's warm-up ran steps too: the generate call's are the last ones.
    assert sum(r["n"] for r in ext[-1:]) == 9  # one extend batch of every prompt's tokens
    assert [r["n"] for r in dec[-3:]] == [3, 3, 3]  # the other 3 tokens of each, together
    assert all(r["dt"] >= 0 for r in rows)
    s = summarize(rows, Window("w", ext[-1]["t"], float("inf")))
    assert (s["extend_steps"], s["decode_steps"], s["decode_batch_mean"]) == (1, 3, 3)
    assert 0 < s["busy_share"] <= 1.0 + 1e-9
    assert main([str(trace_dir)]) == 0
    assert "decode" in capsys.readouterr().out


def test_summary_counts_only_the_window_and_its_gaps(tmp_path):
    rows = [{"t": 10.0, "dt": 0.5, "mode": "extend", "n": 100, "running": 0, "waiting": 1},
            {"t": 11.0, "dt": 0.25, "mode": "decode", "n": 4, "running": 4, "waiting": 0},
            {"t": 11.5, "dt": 0.25, "mode": "decode", "n": 2, "running": 2, "waiting": 0},
            {"t": 20.0, "dt": 1.0, "mode": "decode", "n": 8, "running": 8, "waiting": 0}]
    s = summarize(rows, Window("w", 9.0, 12.0))
    assert (s["extend_steps"], s["decode_steps"], s["decode_batch_mean"]) == (1, 2, 3)
    assert s["window_s"] == pytest.approx(1.75)  # first step's start to the last one's end
    assert s["between_steps_s"] == pytest.approx(0.75)
    assert s["decode_ms_p50"] == pytest.approx(250.0)
    assert summarize(rows, Window("none", 30.0, 40.0)) is None
    path = tmp_path / "steps-1-a.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"pid": 1, "argv": ["x"]}, *rows]))
    assert read_trace(str(path))[1] == rows
