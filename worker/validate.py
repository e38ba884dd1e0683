"""The worker's trust boundary: what reaches it over gRPC is checked here, once.

The router validates client input before it calls a worker, but any gRPC client can call a
worker, so a worker checks every Prefill/Decode request in `validate_request`; the scheduler
behind it trusts what it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto.rpc import sampling_from_proto


class BadRequest(ValueError):
    """Maps to INVALID_ARGUMENT with its message."""


@dataclass(frozen=True)
class ValidRequest:
    input_ids: list[int]
    sampling: SamplingParams


def validate_request(request: pb.PrefillRequest | pb.DecodeRequest, vocab_size: int,
                     max_context_len: int, room_error: str | None) -> ValidRequest:
    """Check a Prefill/Decode request; raise BadRequest naming the field.

    `room_error`: the message when the request needs a room and has none (None: no room
    needed)."""
    try:
        sampling = sampling_from_proto(request.sampling)
        sampling.validate(vocab_size)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    ids = list(request.input_ids)
    if not ids:
        raise BadRequest("input_ids: must contain at least one token")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise BadRequest(f"input_ids: token id {bad} outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_context_len:
        raise BadRequest(f"input_ids: {len(ids)} tokens exceed the context length "
                         f"{max_context_len}")
    if room_error is not None and request.room == 0:
        raise BadRequest(room_error)
    return ValidRequest(ids, sampling)
