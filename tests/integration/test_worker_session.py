"""Worker.Session: calls multiplexed on one stream answer as the RPCs they replace.

Real gRPC on loopback: the router's WorkerSession (router/session.py) against a worker
servicer that serves the session with the workers' own code (worker/session.py).
"""
# ruff: noqa: F811  (pytest fixtures imported from test_router_fakes)

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_router_fakes import FakeWorker, cluster, tokenizer, wait_for  # noqa: F401

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.session import WorkerSession


@pytest.fixture
async def session_to():
    made: list = []

    async def make(fake: FakeWorker) -> tuple[WorkerSession, grpc.aio.Channel]:
        ch = grpc.aio.insecure_channel(fake.address)
        s = WorkerSession(pb_grpc.WorkerStub(ch), None, fake.address)
        made.append((s, ch))
        return s, ch

    yield make
    for s, ch in made:
        await s.close()
        await ch.close()


def _decode(rid: str, max_tokens: int, **kw) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=rid, input_ids=[1, 2, 3],
                            sampling=pb.SamplingParams(max_tokens=max_tokens, **kw))


async def _read_all(call) -> list:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def test_concurrent_calls_answer_as_their_rpcs(session_to):
    fake = await FakeWorker(role="mixed", tokens=[11, 12, 13, 14]).start()
    try:
        s, ch = await session_to(fake)
        rpc = pb_grpc.WorkerStub(ch)
        want = [m async for m in rpc.Decode(_decode("ref", 7, logprobs=2))]
        calls = [s.decode(_decode(f"r{i}", 1 + i % 9, logprobs=2), timeout=10) for i in range(64)]
        got = await asyncio.gather(*(_read_all(c) for c in calls))
        for i, msgs in enumerate(got):
            n = 1 + i % 9
            assert [m.request_id for m in msgs] == [f"r{i}"] * n
            assert [t for m in msgs for t in m.chunk.token_ids] == [11, 12, 13, 14, 11, 12, 13,
                                                                     14, 11][:n]
            assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == n
        for a, b in zip(want, got[6]):  # r6: 7 tokens, as the RPC's
            assert a.chunk == b.chunk and a.finish_reason == b.finish_reason
        pre = await s.prefill(pb.PrefillRequest(request_id="p", input_ids=[1], room=5), timeout=5)
        assert pre.request_id == "p" and pre.cached_tokens == fake.cached_tokens
        assert len(fake.decode_requests) == 65 and not s.closed
    finally:
        await fake.stop()


async def test_errors_cancel_and_deadline(session_to):
    fake = await FakeWorker(role="mixed", token_delay_s=0.05).start()
    try:
        s, _ = await session_to(fake)
        fake.fail_decode, fake.fail_code = 1, grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await s.decode(_decode("bad", 3), timeout=5).read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details() == "injected decode failure"
        fake.fail_prefill = 1
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await s.prefill(pb.PrefillRequest(request_id="p", room=9), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # a call the router gives up is cancelled on the worker, as a cancelled RPC
        call = s.decode(_decode("long", 500), timeout=30)
        assert (await call.read()).chunk.token_ids
        assert call.cancel() and not call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        assert await wait_for(lambda: fake.decode_cancelled == 1)
        # a prefill awaited by a cancelled task is cancelled too
        fake.token_delay_s = 0.0
        task = asyncio.ensure_future(s.prefill(pb.PrefillRequest(request_id="q", room=3), 5))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the deadline ends the call with DEADLINE_EXCEEDED and cancels it on the worker
        fake.token_delay_s = 0.05
        slow = s.decode(_decode("slow", 500), timeout=0.3)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _read_all(slow)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await wait_for(lambda: fake.decode_cancelled == 2)
        assert not s.closed and not s._calls  # one session carried all of it, nothing left open
    finally:
        await fake.stop()


async def test_a_lost_worker_fails_open_calls_and_a_new_session_serves(session_to):
    fake = await FakeWorker(role="mixed", token_delay_s=0.05).start()
    port = fake.port
    try:
        s, _ = await session_to(fake)
        calls = [s.decode(_decode(f"r{i}", 500), timeout=30) for i in range(4)]
        for c in calls:
            await c.read()
        await fake.stop()
        for c in calls:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _read_all(c)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert s.closed and not s._calls
        with pytest.raises(grpc.aio.AioRpcError):
            await s.decode(_decode("late", 2), timeout=5).read()
        fake.port, fake.token_delay_s = port, 0.0
        fake._server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(fake, fake._server)
        fake._server.add_insecure_port(f"127.0.0.1:{port}")
        await fake._server.start()
        s2, _ = await session_to(fake)
        assert len(await _read_all(s2.decode(_decode("again", 3), timeout=10))) == 3
    finally:
        await fake.stop()


async def test_router_multiplexes_and_falls_back_to_rpcs(cluster):
    """The router uses a worker's session when its Status offers one, RPCs otherwise; both
    stream the same answer, and a retired session ends its stream."""
    import httpx

    body = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0}
    texts = []
    for session in (True, False):
        router, fakes = await cluster(num_prefill=1, num_decode=1,
                                      worker_kw={"session": session})
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as c:
            r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
        entries = router.core.registry.all()
        assert all((w.session is not None) == session for w in entries)
        for w in entries:
            if w.session is not None:
                s = w.session
                w.drop_channel()
                assert await wait_for(lambda s=s: s.closed)  # retired and idle: stream ended
    assert texts[0] == texts[1] and texts[0]
