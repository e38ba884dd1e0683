"""`pdserve bench` configuration, arrivals and workloads (no cluster)."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.bench.serve_config import BenchConfig, config_from_args, parse_range
from pdserve.bench.serve_runner import arrival_gaps
from pdserve.bench.serve_workload import build_workload


def test_parse_range_and_config_errors_name_the_field():
    assert parse_range("16", "input_len") == (16, 16)
    assert parse_range("8:32", "input_len") == (8, 32)
    for bad in ("0", "9:3", "x", "1:y"):
        with pytest.raises(ValueError, match="input_len"):
            parse_range(bad, "input_len")
    for kw, field in ((dict(num_prompts=0), "num_prompts"),
                      (dict(request_rate=0.0), "request_rate"),
                      (dict(burstiness=-1.0), "burstiness"),
                      (dict(max_concurrency=0), "max_concurrency"),
                      (dict(dataset="sharegpt"), "dataset_path"),
                      (dict(grpc_addr="h:1", endpoint="chat"), "grpc_addr"),
                      (dict(slo_ttft_ms=0.0), "slo_ttft_ms")):
        with pytest.raises(ValueError, match=field):
            BenchConfig(**kw)
    cfg = config_from_args(["--input-len", "4:8", "--request-rate", "2", "--max-concurrency",
                            "3", "--base-url", "http://h:1/"])
    assert cfg.input_len == (4, 8) and cfg.request_rate == 2 and cfg.base_url == "http://h:1"


def test_arrivals_poisson_gamma_and_all_at_once():
    assert list(arrival_gaps(BenchConfig(), 3)) == [0.0, 0.0, 0.0]
    gaps = list(arrival_gaps(BenchConfig(request_rate=10.0), 4000))
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.08)
    bursty = list(arrival_gaps(BenchConfig(request_rate=10.0, burstiness=0.25), 4000))
    assert sum(bursty) / len(bursty) == pytest.approx(0.1, rel=0.15)

    def cv(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) / m

    assert cv(gaps) == pytest.approx(1.0, abs=0.1) and cv(bursty) > 1.6  # CV = 1/sqrt(shape)


def test_random_workload_lengths_and_warmup():
    cfg = BenchConfig(num_prompts=20, input_len=(5, 9), output_len=(3, 4), seed=1)
    reqs = build_workload(cfg, warmup=2)
    assert len(reqs) == 22
    for r in reqs[2:]:
        assert 5 <= r.input_len <= 9 and len(r.prompt.split()) == r.input_len
        assert 3 <= r.output_len <= 4 and r.messages is None
    assert build_workload(cfg) == build_workload(cfg)  # seeded


def test_shared_prefix_and_multi_turn():
    cfg = BenchConfig(dataset="shared-prefix", endpoint="chat", num_prompts=6, num_prefixes=2,
                      prefix_len=10, input_len=(4, 4), output_len=(2, 2))
    reqs = build_workload(cfg)
    systems = {r.messages[0]["content"] for r in reqs}
    assert len(systems) == 2 and all(r.input_len == 14 for r in reqs)
    cfg = BenchConfig(dataset="multi-turn", endpoint="chat", num_prompts=5, num_turns=3,
                      prefix_len=4, input_len=(3, 3), output_len=(2, 2))
    reqs = build_workload(cfg)
    assert [len(r.messages) for r in reqs] == [2, 2, 4, 4, 6]  # turn-major over 2 convs
    assert reqs[4].messages[:4] == reqs[2].messages[:4]  # history resent as a prefix
    text = build_workload(BenchConfig(dataset="multi-turn", num_prompts=2, num_turns=2))
    assert text[0].prompt.startswith("System: ") and text[0].prompt.endswith("Assistant:")


def test_sharegpt(tmp_path):
    data = [{"conversations": [{"from": "human", "value": "one two three four five"},
                               {"from": "gpt", "value": "a b c d e f g h i j"}]},
            {"conversations": [{"from": "human", "value": "too short"},
                               {"from": "gpt", "value": "fine reply here and more"}]},
            {"conversations": [{"from": "gpt", "value": "starts with the model"}]},
            {"id": "no conversations"}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = build_workload(BenchConfig(dataset="sharegpt", dataset_path=str(path)))
    assert len(reqs) == 1 and reqs[0].prompt == "one two three four five"
    assert reqs[0].output_len == 13  # 10 words x 1.3 without a tokenizer
    path.write_text("[]")
    with pytest.raises(ValueError, match="dataset_path"):
        build_workload(BenchConfig(dataset="sharegpt", dataset_path=str(path)))
