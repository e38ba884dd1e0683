"""Pieces both worker servicers use: request validation, proto conversion, status."""

from __future__ import annotations

import grpc

from pdserve.engine.req import Req
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2 as pb


class BadRequest(ValueError):
    """Maps to INVALID_ARGUMENT with its message."""


def sampling_from_wire(msg: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    from pdserve.router.convert import sampling_from_proto

    try:
        sp = sampling_from_proto(msg)
        sp.validate(vocab_size)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return sp


def check_input_ids(ids: list[int], vocab_size: int, max_context_len: int,
                    max_tokens: int) -> None:
    if not ids:
        raise BadRequest("input_ids: must contain at least one token")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"input_ids: token id {bad} outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_context_len:
        raise BadRequest(f"input_ids: {len(ids)} tokens exceed the context length "
                         f"{max_context_len}")


def tokens_chunk(req: Req, num_new: int) -> pb.TokenChunk:
    ids = req.output_ids[-num_new:]
    chunk = pb.TokenChunk(token_ids=ids)
    if req.sampling.logprobs is not None and req.output_logprobs:
        chunk.logprobs.extend(req.output_logprobs[-num_new:])
        if req.sampling.logprobs and req.output_top_logprobs:
            for tids, tlps in req.output_top_logprobs[-num_new:]:
                chunk.top_logprobs.add(token_ids=tids, logprobs=tlps)
    return chunk


def load_message(snapshot: dict) -> pb.WorkerLoad:
    return pb.WorkerLoad(
        num_running=int(snapshot.get("num_running", 0)),
        num_waiting=int(snapshot.get("num_waiting", 0)),
        num_inflight=int(snapshot.get("num_inflight", 0)),
        kv_pages_total=int(snapshot.get("kv_pages_total", 0)),
        kv_pages_free=int(snapshot.get("kv_pages_free", 0)),
        kv_pages_cached=int(snapshot.get("kv_pages_cached", 0)),
        kv_pages_in_use=int(snapshot.get("kv_pages_in_use", 0)))


async def abort_invalid(context: grpc.aio.ServicerContext, e: Exception) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
