"""Bad input straight at the workers' gRPC API (what a buggy or hostile client could send), and
incompatible prefill/decode pairs: the right status with a message, nothing leaked."""
# ruff: noqa: F811  (pytest fixtures imported from test_faults_procs)

from __future__ import annotations

import asyncio
import time

import grpc
from test_faults_procs import post, procs  # noqa: F401 (fixture)

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

SP = pb.SamplingParams(max_tokens=4, temperature=0)


async def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_worker_grpc_rejects_bad_requests(procs):
    procs.start_router()
    prefill, decode = procs.start_workers("prefill", "decode")
    procs.wait_healthy(2)
    invalid = grpc.StatusCode.INVALID_ARGUMENT

    async def run() -> None:
        async with grpc.aio.insecure_channel(prefill.fields["grpc"]) as pch, \
                grpc.aio.insecure_channel(decode.fields["grpc"]) as dch:
            p, d = pb_grpc.WorkerStub(pch), pb_grpc.WorkerStub(dch)
            cases = [
                (lambda: p.Prefill(pb.PrefillRequest(input_ids=[], room=7, sampling=SP)),
                 invalid, "input_ids"),
                (lambda: p.Prefill(pb.PrefillRequest(input_ids=[1, 10**6], room=7,
                                                     sampling=SP)), invalid, "vocabulary"),
                (lambda: p.Prefill(pb.PrefillRequest(input_ids=[-3], room=7, sampling=SP)),
                 invalid, "vocabulary"),
                (lambda: p.Prefill(pb.PrefillRequest(input_ids=[1] * 4096, room=7,
                                                     sampling=SP)), invalid, "context"),
                (lambda: p.Prefill(pb.PrefillRequest(input_ids=[1, 2], room=0, sampling=SP)),
                 invalid, "room"),
                (lambda: p.Prefill(pb.PrefillRequest(
                    input_ids=[1, 2], room=7, sampling=pb.SamplingParams(temperature=-1))),
                 invalid, "temperature"),
                (lambda: p.Prefill(pb.PrefillRequest(
                    input_ids=[1, 2], room=7, sampling=pb.SamplingParams(top_p=7))),
                 invalid, "top_p"),
                (lambda: d.Decode(pb.DecodeRequest(input_ids=[1, 2], room=0, sampling=SP,
                                                   bootstrap_addr="127.0.0.1:1")),
                 invalid, "room"),
                (lambda: d.Decode(pb.DecodeRequest(input_ids=[], sampling=SP)), invalid,
                 "input_ids"),
                (lambda: d.Prefill(pb.PrefillRequest(input_ids=[1], room=7, sampling=SP)),
                 grpc.StatusCode.UNIMPLEMENTED, "prefill"),
                (lambda: p.Decode(pb.DecodeRequest(input_ids=[1], sampling=SP)),
                 grpc.StatusCode.UNIMPLEMENTED, ""),
            ]
            for call, want, word in cases:
                code, details = await _code(call)
                assert code == want, (code, details, word)
                assert word.lower() in details.lower() and "Traceback" not in details, details
            # A forged bootstrap address (nobody there): refused within the bootstrap deadline.
            t0 = time.monotonic()
            code, details = await _code(lambda: d.Decode(pb.DecodeRequest(
                request_id="forged", input_ids=list(range(3, 30)), room=99, sampling=SP,
                bootstrap_addr="127.0.0.1:9"), timeout=60))
            assert code == grpc.StatusCode.ABORTED and details, (code, details)
            assert time.monotonic() - t0 < 20
            # A forged room at the real prefill worker: no Prefill ever comes for it, so decode
            # gives up at its deadline; the prefill worker holds nothing for it.
            t0 = time.monotonic()
            code, details = await _code(lambda: d.Decode(pb.DecodeRequest(
                request_id="forged-room", input_ids=list(range(3, 30)), room=4242, sampling=SP,
                bootstrap_addr=prefill.fields["bootstrap"]), timeout=60))
            assert code == grpc.StatusCode.ABORTED and details, (code, details)
            assert time.monotonic() - t0 < 30
            found = await d.Abort(pb.AbortRequest(room=424242))  # unknown room: a no-op
            assert not found.found

    asyncio.run(run())
    procs.wait_idle(30)
    status, body = post(f"{procs.url}/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert status == 200, body


def test_incompatible_pair_is_refused_naming_the_mismatch(procs):
    """Prefill and decode with different page sizes: the handshake refuses the pair with an
    error naming the field; the client gets a clear 502; nothing stays allocated."""
    procs.start_router()
    # A wide heartbeat window: on a loaded 2-core machine a 2 s stall of the prefill process
    # would otherwise fail the room as "silent" before its refusal arrives.
    slow_hb = ("--heartbeat-interval=1", "--heartbeat-misses=15")
    procs.start_workers("prefill", args=("--page-size=16", *slow_hb))
    procs.start_workers("decode", args=("--page-size=8", *slow_hb))
    procs.wait_healthy(2)
    status, body = post(f"{procs.url}/v1/completions", {"prompt": "hello " * 20,
                                                         "max_tokens": 3}, timeout_s=120)
    assert status == 502, body
    message = body["error"]["message"]
    assert "page" in message.lower(), message
    procs.wait_idle(30)
