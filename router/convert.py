"""Conversions between `SamplingParams` / worker info and their protobuf wire forms."""

from __future__ import annotations

from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2 as pb

# Proto fields declared `optional` (their proto zero is not the default): copied only when set.
_OPTIONAL = ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "logprobs",
             "skip_special_tokens")
_PLAIN = ("min_tokens", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos")


def sampling_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    """Full wire form: every field is written, so the worker sees exactly these values."""
    msg = pb.SamplingParams(
        min_tokens=sp.min_tokens, top_k=sp.top_k, min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
        stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
        repetition_penalty=sp.repetition_penalty, skip_special_tokens=sp.skip_special_tokens,
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    return msg


def sampling_dict_from_proto(msg: pb.SamplingParams) -> dict[str, Any]:
    """Fields the sender set, as a dict (unset `optional` fields keep SamplingParams defaults).

    Floats are rounded to 6 significant digits: proto floats are 32-bit, and 0.9 must stay 0.9.
    """
    out: dict[str, Any] = {}
    for name in _OPTIONAL:
        if msg.HasField(name):
            out[name] = getattr(msg, name)
    for name in _PLAIN:
        out[name] = getattr(msg, name)
    if msg.stop:
        out["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        out["stop_token_ids"] = tuple(msg.stop_token_ids)
    if "top_k" in out and out["top_k"] == 0:
        out["top_k"] = -1
    for key, value in out.items():
        if isinstance(value, float):
            out[key] = float(f"{value:.6g}")
    return out


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field when a value is out of range."""
    return SamplingParams.from_dict(sampling_dict_from_proto(msg))


def load_to_dict(load: pb.WorkerLoad) -> dict[str, int]:
    return {
        "num_running": load.num_running,
        "num_waiting": load.num_waiting,
        "num_inflight": load.num_inflight,
        "kv_pages_total": load.kv_pages_total,
        "kv_pages_free": load.kv_pages_free,
        "kv_pages_cached": load.kv_pages_cached,
        "kv_pages_in_use": load.kv_pages_in_use,
    }
