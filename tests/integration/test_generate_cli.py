"""`pdserve generate` end to end, and its errors: clear messages, exit 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "generate", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def _prompts(tmp_path: Path, *prompts: str) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_generate_json_lines_and_summary(tiny_model_dir, tmp_path):
    res = _run("--model", tiny_model_dir, "--prompts", _prompts(tmp_path, "hello", "the fox"),
               "--max-tokens", "5", "--json")
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["prompt"] for x in lines[:2]] == ["hello", "the fox"]
    assert all(len(x["token_ids"]) == 5 and isinstance(x["text"], str) for x in lines[:2])
    assert lines[2]["tokens_per_s"] > 0 and lines[2]["load_s"] >= 0


def _assert_clean_error(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    for w in words:
        assert w in res.stderr, res.stderr


def test_unknown_architecture(tiny_model_dir, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    _assert_clean_error(_run("--model", str(bad), "--prompts", _prompts(tmp_path, "hi")),
                        "FooBarForCausalLM")


def test_missing_weight_file(tiny_model_dir, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(tiny_model_dir, bad)
    for f in bad.glob("*.safetensors"):
        f.unlink()
    _assert_clean_error(_run("--model", str(bad), "--prompts", _prompts(tmp_path, "hi")),
                        "safetensors")


def test_invalid_sampling_and_input(tiny_model_dir, tmp_path):
    prompts = _prompts(tmp_path, "hi")
    _assert_clean_error(_run("--model", tiny_model_dir, "--prompts", prompts,
                             "--temperature", "-1"), "temperature")
    _assert_clean_error(_run("--model", tiny_model_dir, "--prompts", prompts,
                             "--max-tokens", "0"), "max_tokens")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    _assert_clean_error(_run("--model", tiny_model_dir, "--prompts",
                             str(tmp_path / "bad.jsonl")), "not JSON")


def test_prompt_past_context(tiny_model_dir, tmp_path):
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    long_prompt = [3 + i % 200 for i in range(cfg["max_position_embeddings"] + 5)]
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": long_prompt}) + "\n")
    _assert_clean_error(_run("--model", tiny_model_dir, "--prompts",
                             str(tmp_path / "long.jsonl")), "context")


def test_errors_leave_no_pages_held(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, device="cpu", num_pages=64, page_size=4)
    ok = list(range(3, 20))
    too_long = [3 + i % 200 for i in range(llm.memory.max_context_len + 1)]
    with pytest.raises(ValueError, match="context"):
        llm.generate([ok, too_long], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([ok], SamplingParams(max_tokens=4, temperature=-2))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], SamplingParams(max_tokens=4))
    st = llm.memory.stats()
    assert st.kv_pages_in_use == 0 and llm.memory.req_to_token.num_used == 0, st
    assert len(llm.generate([ok], SamplingParams(max_tokens=4))[0].token_ids) == 4


@pytest.mark.timeout(120)
def test_context_is_bounded_by_the_pool(tiny_model_dir):
    """A pool smaller than the model's context bounds it: a prompt that could never be admitted
    is refused at once (it used to wait for pages for ever), and requests that would outgrow
    the pool end with `length` at its size, one after another if need be."""
    llm = LLM(model=tiny_model_dir, device="cpu", num_pages=40, page_size=4)
    assert llm.memory.max_context_len == 39 * 4  # page 0 is reserved
    with pytest.raises(ValueError, match="context of 156"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=4))
    outs = llm.generate([[5] * 140, [7] * 140], SamplingParams(max_tokens=40, ignore_eos=True))
    assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(16, "length")] * 2
    assert llm.memory.stats().kv_pages_in_use == 0
