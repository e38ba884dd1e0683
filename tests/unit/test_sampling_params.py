"""SamplingParams: defaults, validation messages that name the field, wire round trip."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.sampling_params import SamplingParams


def test_defaults_are_valid_and_not_greedy() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_k == -1
    assert p.stop == () and p.stop_token_ids == () and p.logprobs is None
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy
    p.validate(vocab_size=10)


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("max_tokens", 0, "must be an integer >= 1"),
        ("max_tokens", 1.5, "must be an integer >= 1"),
        ("min_tokens", -1, "must be an integer >= 0"),
        ("temperature", -1, "must be >= 0, got -1"),
        ("temperature", float("nan"), "must be a number"),
        ("top_p", 0.0, "must be > 0 and <= 1"),
        ("top_p", 1.5, "must be > 0 and <= 1"),
        ("top_k", -2, "must be -1, 0 (off) or >= 1"),
        ("min_p", 1.1, "must be >= 0 and <= 1"),
        ("seed", 1.5, "must be an integer or None"),
        ("repetition_penalty", 0.0, "must be > 0"),
        ("frequency_penalty", 2.5, "<= 2"),
        ("presence_penalty", -3.0, "must be >= -2"),
        ("stop", ("ok", ""), "non-empty strings"),
        ("stop_token_ids", (-1,), "integers >= 0"),
        ("ignore_eos", "yes", "must be a bool"),
        ("logprobs", 21, "[0, 20]"),
        ("logprobs", -1, "[0, 20]"),
        ("skip_special_tokens", None, "must be a bool"),
    ],
)
def test_validation_names_field(field: str, value: object, expect: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert msg.startswith(f"{field}:"), msg
    assert expect in msg, msg


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"^min_tokens: must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_stop_token_ids_checked_against_vocab() -> None:
    p = SamplingParams(stop_token_ids=(3, 99))
    p.validate()
    with pytest.raises(ValueError, match=r"^stop_token_ids: must be in \[0, 50\)"):
        p.validate(vocab_size=50)
    p.validate(vocab_size=100)


def test_lists_and_bare_string_become_tuples() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])
    assert p.stop == ("a", "b") and p.stop_token_ids == (1, 2)
    assert SamplingParams(stop="END").stop == ("END",)
    hash(p)  # frozen and hashable


def test_wire_round_trip_through_json() -> None:
    p = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05,
                       seed=123, repetition_penalty=1.1, frequency_penalty=0.2,
                       presence_penalty=-0.3, stop=("\n\n", "END"), stop_token_ids=(2,),
                       ignore_eos=True, logprobs=5, skip_special_tokens=False, min_tokens=2)
    wire = json.loads(json.dumps(p.to_dict()))
    assert wire["stop"] == ["\n\n", "END"]
    assert SamplingParams.from_dict(wire) == p


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['best_of', 'n'\]"):
        SamplingParams.from_dict({"temperature": 0.0, "n": 2, "best_of": 3})
    with pytest.raises(ValueError, match="^sampling_params:"):
        SamplingParams.from_dict([("temperature", 0.0)])  # type: ignore[arg-type]


def test_from_dict_validates() -> None:
    with pytest.raises(ValueError, match="^top_p:"):
        SamplingParams.from_dict({"top_p": 0})
