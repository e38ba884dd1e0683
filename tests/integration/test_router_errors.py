"""Bad input gets the OpenAI error shape with the right 4xx/5xx status, never a 500."""
# ruff: noqa: F811  (pytest fixtures imported from test_router_fakes)

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from test_router_fakes import cluster, tokenizer  # noqa: F401 (fixtures)

from pdserve.proto import pdserve_pb2 as pb


def _check(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture
async def gateway(cluster):
    router, fakes = await cluster(worker_kw={"max_context_len": 64})
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as http:
        yield http, router, fakes


CASES = [
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty"),
    ({}, "prompt"),
]


async def test_completion_validation(gateway):
    http, _, fakes = gateway
    for body, param in CASES:
        _check(await http.post("/v1/completions", json=body), 400, param)
    assert not fakes["decode"][0].decode_requests  # nothing reached a worker


async def test_chat_validation(gateway):
    http, _, _ = gateway
    _check(await http.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    _check(await http.post("/v1/chat/completions", json={"messages": [{"role": "x"}]}), 400,
           "messages")
    _check(await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}), 400, "top_logprobs")


async def test_malformed_and_oversized_and_routes(gateway):
    http, router, _ = gateway
    headers = {"content-type": "application/json"}
    _check(await http.post("/v1/completions", content=b"{not json", headers=headers), 400)
    _check(await http.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)
    _check(await http.post("/v1/completions", content=b'{"prompt": NaN}', headers=headers), 400)
    big = b'{"prompt": "' + b"a" * (router.config.max_body_bytes + 10) + b'"}'
    _check(await http.post("/v1/completions", content=big, headers=headers), 413)
    _check(await http.get("/v1/nothing"), 404)
    err = _check(await http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}),
                 404, "model")
    assert err["code"] == "model_not_found"


async def test_context_length(gateway, tokenizer):
    http, _, _ = gateway
    long_prompt = " ".join(["hello world"] * 60)
    assert len(tokenizer.encode(long_prompt)) >= 64
    err = _check(await http.post("/v1/completions", json={"prompt": long_prompt}), 400, "prompt")
    assert "64" in err["message"] and err["code"] == "context_length_exceeded"
    err = _check(await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100}),
                 400, "max_tokens")
    assert "64" in err["message"]


async def test_no_workers_is_503(cluster):
    router, _ = await cluster(num_prefill=0, num_decode=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as http:
        _check(await http.post("/v1/completions", json={"prompt": "hi"}), 503)
        _check(await http.get("/health"), 503)


async def test_api_key(cluster):
    router, _ = await cluster(api_key="sekrit")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as http:
        _check(await http.post("/v1/completions", json={"prompt": "hi"}), 401)
        _check(await http.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200
        assert (await http.get("/health")).status_code == 200  # probes need no key


async def test_full_queue_is_429_at_once_with_retry_after(cluster):
    """Decode runs 2 at once and --max-queued-requests is 1: of 6 concurrent requests 3 are
    served (2 running, 1 queued) and 3 refused at once, with Retry-After and the OpenAI body."""
    load = pb.WorkerLoad(kv_pages_total=100, kv_pages_free=90, max_running=2)
    router, fakes = await cluster(worker_kw={"load": load, "token_delay_s": 0.3},
                                  max_queued_requests=1)
    base = f"http://127.0.0.1:{router.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        async def one() -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = await http.post("/v1/completions",
                                json={"prompt": "hi", "max_tokens": 4, "stream": True})
            return r, time.monotonic() - t0

        results = await asyncio.gather(*(one() for _ in range(6)))
        served = [r for r, _ in results if r.status_code == 200]
        refused = [(r, dt) for r, dt in results if r.status_code == 429]
        assert len(served) == 3 and len(refused) == 3, [r.status_code for r, _ in results]
        assert all("[DONE]" in r.text for r in served)
        for r, dt in refused:
            err = _check(r, 429)
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
            assert int(r.headers["Retry-After"]) >= 1
            assert dt < 1.0  # refused at once, not after waiting
        assert len(fakes["decode"][0].decode_requests) == 3  # the refused never reached it
        # Idle again: admitted, and the limit shows in /workers and /metrics.
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        decode = [w for w in (await http.get("/workers")).json()["workers"]
                  if w["role"] == "decode"]
        assert decode[0]["max_running"] == 2 and decode[0]["queued"] == 0
        metrics = (await http.get("/metrics")).text
        assert 'pdserve_router_requests_total{endpoint="completions",status="429"} 3.0' in metrics
        assert "pdserve_router_queued_requests 0.0" in metrics
