"""Routing policies, RouterConfig validation and SamplingParams <-> proto conversion."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.rpc import sampling_from_proto, sampling_to_proto
from pdserve.router.config import RouterConfig
from pdserve.router.policies import CacheAware, LeastLoad, PowerOfTwo, RoundRobin
from pdserve.router.registry import WorkerEntry


def _workers(*loads: int) -> list[WorkerEntry]:
    return [WorkerEntry(worker_id=f"w{i}", address=f"127.0.0.1:{1000 + i}", role="prefill",
                        static=True, state="healthy", inflight=load)
            for i, load in enumerate(loads)]


def test_round_robin_cycles() -> None:
    ws = _workers(0, 0, 0)
    rr = RoundRobin()
    assert [rr.pick(ws, []).worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]


def test_least_load_and_power_of_two() -> None:
    ws = _workers(5, 1, 3)
    assert LeastLoad().pick(ws, []).worker_id == "w1"
    p2 = PowerOfTwo(random.Random(0))
    picks = [p2.pick(ws, []).worker_id for _ in range(50)]
    assert "w0" not in picks  # the busiest never wins a pairwise comparison
    assert p2.pick(ws[:1], []).worker_id == "w0"


def test_cache_aware_prefix_affinity_and_balance_escape() -> None:
    ws = _workers(0, 0)
    ca = CacheAware(balance_abs=4, balance_rel=1.5, min_match=0.5, block_len=4)
    prompt_a = list(range(100, 116))
    prompt_b = list(range(200, 216))
    first_a = ca.pick(ws, prompt_a)
    ws[ws.index(first_a)].inflight += 1
    first_b = ca.pick(ws, prompt_b)
    assert first_b is not first_a  # least load for an unseen prompt
    for _ in range(3):  # shared prefix, new suffix: stays on the worker that saw the prefix
        assert ca.pick(ws, prompt_a[:12] + [1, 2, 3, 4]) is first_a
    first_a.inflight = 20  # badly imbalanced: affinity yields to least load
    assert ca.pick(ws, prompt_a) is first_b


def test_config_validation_names_field() -> None:
    cfg = RouterConfig(prefill_addrs=["127.0.0.1:5"], decode_addrs=("h:6",))
    assert cfg.prefill_addrs == ("127.0.0.1:5",)
    for kwargs, field in [({"http_port": 70000}, "http_port"),
                          ({"prefill_policy": "random"}, "prefill_policy"),
                          ({"decode_policy": "cache_aware"}, "decode_policy"),
                          ({"lease_s": 1.0, "heartbeat_interval_s": 2.0}, "lease_s"),
                          ({"decode_addrs": ("nohost",)}, "decode_addrs"),
                          ({"retries": -1}, "retries"),
                          ({"api_key": ""}, "api_key")]:
        with pytest.raises(ValueError, match=field):
            RouterConfig(**kwargs)
    assert RouterConfig(model_path="/models/SmolLM2/").model_name == "SmolLM2"


def test_sampling_round_trip() -> None:
    sp = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3,
                        repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=-0.5,
                        stop=("x", "yz"), stop_token_ids=(4,), ignore_eos=True, logprobs=0,
                        skip_special_tokens=False)
    assert sampling_from_proto(sampling_to_proto(sp)) == sp
    default = SamplingParams()
    assert sampling_from_proto(sampling_to_proto(default)) == default
    assert sampling_from_proto(pb.SamplingParams()) == default  # unset optional fields
    with pytest.raises(ValueError, match="top_p"):
        sampling_from_proto(pb.SamplingParams(top_p=1.5))
