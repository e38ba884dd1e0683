"""Bad input gets the OpenAI error shape with the right 4xx/5xx status, never a 500."""
# ruff: noqa: F811  (pytest fixtures imported from test_router_fakes)

from __future__ import annotations

import httpx
import pytest
from test_router_fakes import cluster, tokenizer  # noqa: F401 (fixtures)


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
