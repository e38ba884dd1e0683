"""The Router gRPC service: Generate, registration with leases, health removal, draining."""
# ruff: noqa: F811  (pytest fixtures imported from test_router_fakes)

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_router_fakes import FakeWorker, cluster, tokenizer, wait_for  # noqa: F401

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc


@pytest.fixture
async def stub_of():
    channels = []

    def make(router):
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}")
        channels.append(ch)
        return pb_grpc.RouterStub(ch), ch

    yield make
    for ch in channels:
        await ch.close()


async def test_generate_stream_and_errors(cluster, stub_of, tokenizer):
    router, fakes = await cluster()
    stub, ch = stub_of(router)
    req = pb.GenerateRequest(text="hello", stream=True,
                             sampling=pb.SamplingParams(max_tokens=5, temperature=0.0))
    msgs = [m async for m in stub.Generate(req)]
    assert "".join(m.text for m in msgs) == tokenizer.decode(fakes["decode"][0].tokens[:5])
    last = msgs[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 5
    assert last.timings.prefill_ms == 3.0 and last.timings.transfer_ms == 4.0
    assert last.prefill_worker == fakes["prefill"][0].address
    sent = fakes["decode"][0].decode_requests[0].sampling
    assert sent.temperature == 0.0 and sent.max_tokens == 5
    # non-streaming: one message with everything
    one = [m async for m in stub.Generate(pb.GenerateRequest(input_ids=[5, 6, 7]))]
    assert len(one) == 1 and len(one[0].chunk.token_ids) == 16
    for bad in (pb.GenerateRequest(), pb.GenerateRequest(text="x", input_ids=[1]),
                pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=2.0))):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [m async for m in stub.Generate(bad)]
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details()
    health = health_pb2_grpc.HealthStub(ch)
    resp = await health.Check(health_pb2.HealthCheckRequest())
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_abort_rpc_ends_stream(cluster, stub_of):
    router, fakes = await cluster(worker_kw={"token_delay_s": 0.05})
    stub, _ = stub_of(router)
    call = stub.Generate(pb.GenerateRequest(request_id="r1", text="hi", stream=True,
                                            sampling=pb.SamplingParams(max_tokens=500)))
    first = await call.read()
    assert first.request_id == "r1"
    assert (await stub.Abort(pb.AbortRequest(request_id="r1"))).found
    msgs = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        msgs.append(msg)
    assert msgs[-1].finish_reason == "abort"
    assert await wait_for(lambda: fakes["decode"][0].aborts and fakes["prefill"][0].aborts)


async def test_registration_lease_and_draining(cluster, stub_of):
    router, _ = await cluster(num_prefill=0, num_decode=0, registration_secret="s3",
                              heartbeat_interval_s=0.1, lease_s=0.5)
    stub, _ = stub_of(router)
    mixed = await FakeWorker(role="mixed").start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=mixed.info(), secret="no"))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        reg = await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=mixed.info(),
                                                                 secret="s3"))
        assert reg.worker_id and reg.lease_s == 0.5
        listed = (await stub.ListWorkers(pb.ListWorkersRequest())).workers
        assert [(w.role, w.state) for w in listed] == [("mixed", "healthy")]
        # draining: listed, but gets no new requests
        hb = await stub.Heartbeat(pb.HeartbeatRequest(worker_id=reg.worker_id, secret="s3",
                                                      draining=True))
        assert hb.known
        assert router.core.registry.available("mixed") == []
        await stub.Heartbeat(pb.HeartbeatRequest(worker_id=reg.worker_id, secret="s3"))
        assert len(router.core.registry.available("mixed")) == 1
        # no heartbeats: the lease runs out and the worker is forgotten
        assert await wait_for(lambda: not router.core.registry.all(), timeout=3.0)
        hb = await stub.Heartbeat(pb.HeartbeatRequest(worker_id=reg.worker_id, secret="s3"))
        assert not hb.known
        reg = await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=mixed.info(),
                                                                 secret="s3"))
        await stub.Deregister(pb.DeregisterRequest(worker_id=reg.worker_id, secret="s3"))
        assert not router.core.registry.all()
    finally:
        await mixed.stop()


async def test_health_failure_removes_and_restores(cluster):
    router, fakes = await cluster()
    reg = router.core.registry
    decode = fakes["decode"][0]
    await decode.set_serving(False)
    assert await wait_for(lambda: reg.available("decode") == [])
    await decode.set_serving(True)
    assert await wait_for(lambda: len(reg.available("decode")) == 1)
    await fakes["prefill"][0].stop()  # gone entirely
    assert await wait_for(lambda: reg.available("prefill") == [])
    async with httpx.AsyncClient() as http:
        r = await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                            json={"prompt": "hi"})
    assert r.status_code == 503


async def test_main_prints_ready_line(tiny_model_dir):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; from pdserve.router.main import main; "
        "sys.exit(main(sys.argv[1:]))", "--model", tiny_model_dir, "--log-level", "warning",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode().strip()
        assert line.startswith("router ready http=http://127.0.0.1:"), line
        http_url = line.split()[2].removeprefix("http=")
        grpc_addr = line.split()[3].removeprefix("grpc=")
        async with httpx.AsyncClient() as http:
            models = (await http.get(f"{http_url}/v1/models")).json()
            assert models["data"][0]["id"] == os.path.basename(tiny_model_dir)
            assert (await http.get(f"{http_url}/health")).status_code == 503
        async with grpc.aio.insecure_channel(grpc_addr) as ch:
            listed = await pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest())
            assert list(listed.workers) == []
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), timeout=20) == 0
