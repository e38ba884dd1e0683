"""Conditional disaggregation decisions, the config knobs and the gRPC auth checks."""

from __future__ import annotations

import pytest

from pdserve.proto.rpc import api_key_check, secret_check
from pdserve.router.config import RouterConfig
from pdserve.router.disagg import DisaggPolicy
from pdserve.router.registry import WorkerEntry


def _decode(wid: str = "d0") -> WorkerEntry:
    return WorkerEntry(worker_id=wid, address="127.0.0.1:1", role="decode", static=True,
                       state="healthy")


def test_threshold_zero_always_disaggregates() -> None:
    d = DisaggPolicy(0).decide(list(range(5)), _decode(), True, False)
    assert d is not None and d.disaggregated and d.reason == "always"
    assert DisaggPolicy(0).decide([1, 2], _decode(), False, False) is None  # no prefill: 503
    local = DisaggPolicy(0).decide([1, 2], _decode(), False, True)
    assert local is not None and not local.disaggregated and local.reason == "no_prefill_worker"


def test_short_prompts_stay_local_long_ones_go_remote() -> None:
    policy = DisaggPolicy(32, block_len=4)
    short = policy.decide(list(range(10)), _decode(), True, False)
    assert short is not None and not short.disaggregated and short.reason == "short_prompt"
    assert short.uncached_len == 10 and short.threshold == 32
    long = policy.decide(list(range(200, 300)), _decode(), True, False)
    assert long is not None and long.disaggregated and long.reason == "long_prompt"
    assert long.to_json() == {"disaggregated": True, "reason": "long_prompt", "prompt_len": 100,
                              "uncached_len": 100, "threshold": 32}


def test_prefix_cached_on_decode_counts_as_cached() -> None:
    policy = DisaggPolicy(16, block_len=4)
    system = list(range(100, 140))  # 40 tokens
    first = policy.decide(system[:12], _decode(), True, False)  # short: prefilled locally
    assert first is not None and not first.disaggregated
    # A long prompt that starts with what d0 already prefilled has a short uncached part.
    again = policy.decide(system[:12] + [7, 8, 9, 10, 11], _decode(), True, False)
    assert again is not None and again.uncached_len == 5 and not again.disaggregated
    other = policy.decide(system[:12] + [7, 8, 9, 10, 11] * 4, _decode("d1"), True, False)
    assert other is not None and other.uncached_len == 32 and other.disaggregated
    policy.forget_except([_decode("d1")])  # d0 left (or restarted): its cache is gone
    gone = policy.decide(system[:12] + [7, 8, 9, 10, 11] * 4, _decode(), True, False)
    assert gone is not None and gone.uncached_len == 32


def test_config_validation_names_fields() -> None:
    with pytest.raises(ValueError, match="disagg_threshold"):
        RouterConfig(disagg_threshold=-1)
    with pytest.raises(ValueError, match="tls_cert_file"):
        RouterConfig(tls_cert_file="cert.pem")
    assert RouterConfig(disagg_threshold=512).disagg_threshold == 512


def test_auth_checks() -> None:
    check = api_key_check("k", ("/pdserve.v1.Router/Generate",))
    assert check("/pdserve.v1.Router/Generate", {}) is not None
    assert check("/pdserve.v1.Router/Generate", {"authorization": "Bearer k"}) is None
    assert check("/pdserve.v1.Router/Generate", {"authorization": "Bearer x"}) is not None
    assert check("/pdserve.v1.Router/Heartbeat", {}) is None  # guarded by the secret instead
    assert api_key_check(None, ("/x",))("/x", {}) is None
    sc = secret_check("s")
    assert sc("/pdserve.v1.Worker/Decode", {"x-pdserve-secret": "s"}) is None
    assert "secret" in (sc("/pdserve.v1.Worker/Decode", {"x-pdserve-secret": "t"}) or "")
    assert secret_check(None)("/pdserve.v1.Worker/Decode", {}) is None
