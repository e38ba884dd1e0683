"""Prefill-side faults with real processes: a prefill worker SIGKILLed while it holds requests,
a prefill that never hears from its decode peer (bootstrap timeout)."""
# ruff: noqa: F811  (pytest fixtures imported from test_faults_procs)

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import grpc
from test_faults_procs import post, procs  # noqa: F401 (fixture)

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

BODY = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}


def test_prefill_killed_with_requests_inside_retries_on_fresh_pair(procs):
    procs.start_router()
    victim, _, _ = procs.start_workers("prefill", "prefill", "decode")
    procs.wait_healthy(3)
    url = f"{procs.url}/v1/completions"
    # Frozen, the victim holds every request sent to it (in bootstrap or prefill) when killed.
    victim.signal(signal.SIGSTOP)
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, url, {**BODY, "prompt": f"{BODY['prompt']} {i}"})
                   for i in range(8)]
        time.sleep(1.0)
        victim.signal(signal.SIGKILL)
        victim.signal(signal.SIGCONT)
        results = [f.result() for f in futures]
    # None had sent a token: each one that met the victim was retried once on a fresh pair.
    assert [s for s, _ in results] == [200] * 8, results
    for _, body in results:
        assert body["choices"][0]["finish_reason"] == "length"
        used = body["pdserve"]["choices"][0]["prefill_worker"]
        assert used != victim.fields["grpc"]
    retries = [ln for ln in procs.metrics().splitlines()
               if ln.startswith("pdserve_router_retries_total")]
    assert retries and float(retries[0].split()[-1]) >= 1, retries
    # The dead worker leaves rotation; the survivors hold no page; new requests succeed.
    procs.wait_workers(lambda ws: all(w["address"] != victim.fields["grpc"]
                                      or w["state"] != "healthy" for w in ws), 30)
    procs.wait_workers(lambda ws: all(w["kv_pages_in_use"] == 0 for w in ws
                                      if w["address"] != victim.fields["grpc"]), 60)
    status, body = post(url, BODY)
    assert status == 200, body


def test_prefill_without_decode_peer_times_out_and_frees(procs):
    """A Prefill whose room no decode worker ever registers fails at the bootstrap deadline
    (5 s here) with ABORTED and a message; nothing stays allocated."""
    procs.start_router()
    prefill = procs.start_worker("prefill")
    procs.wait_healthy(1)

    async def call() -> tuple[grpc.StatusCode, str, float]:
        async with grpc.aio.insecure_channel(prefill.fields["grpc"]) as ch:
            stub = pb_grpc.WorkerStub(ch)
            t0 = time.monotonic()
            try:
                await stub.Prefill(pb.PrefillRequest(
                    request_id="orphan", input_ids=list(range(3, 40)), room=12345,
                    sampling=pb.SamplingParams(max_tokens=4)), timeout=60)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or "", time.monotonic() - t0
            return grpc.StatusCode.OK, "", time.monotonic() - t0

    import asyncio

    code, details, elapsed = asyncio.run(call())
    assert code == grpc.StatusCode.ABORTED, (code, details)
    assert "12345" in details and details, details
    assert 4.0 <= elapsed < 20.0, elapsed
    procs.wait_idle(30)
