"""The router's OpenAI gateway against Worker doubles on loopback: happy paths, retries, aborts."""
# ruff: noqa: F811  (pytest fixtures imported from test_router_fakes)

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import openai
import pytest
from test_router_fakes import cluster, tokenizer, wait_for  # noqa: F401 (fixtures)

from pdserve.router.server import RouterServer


def _client(router: RouterServer, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1",
                              api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


async def test_completion_non_stream(cluster, tokenizer):
    router, fakes = await cluster()
    ids = fakes["decode"][0].tokens
    resp = await _client(router).completions.create(model="tiny", prompt="hello", max_tokens=4,
                                                    logprobs=2)
    assert resp.choices[0].text == tokenizer.decode(ids[:4])
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 4
    assert resp.usage.prompt_tokens == len(tokenizer.encode("hello"))
    assert resp.usage.prompt_tokens_details.cached_tokens == min(3, resp.usage.prompt_tokens)
    assert resp.choices[0].logprobs.token_logprobs == [-0.5] * 4
    assert len(resp.choices[0].logprobs.top_logprobs[0]) == 2
    p, d = fakes["prefill"][0], fakes["decode"][0]
    assert p.prefill_requests[0].room == d.decode_requests[0].room
    assert 0 < d.decode_requests[0].room < 2**63
    assert d.decode_requests[0].bootstrap_addr == p.info().bootstrap_addr
    assert d.decode_requests[0].sampling.max_tokens == 4
    extra = resp.model_extra["pdserve"]["choices"][0]
    assert extra["timings"]["prefill_ms"] == 3.0 and extra["timings"]["decode_ms"] == 5.0


async def test_chat_stream_and_stop_string(cluster, tokenizer):
    router, fakes = await cluster()
    client = _client(router)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    full = tokenizer.decode(fakes["decode"][0].tokens[:8])
    assert "".join(parts) == full and finish == "length" and usage.completion_tokens == 8
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert list(fakes["decode"][0].decode_requests[0].input_ids) == tokenizer.encode(
        prompt, add_special_tokens=False)
    # A stop string cuts the text and aborts both legs (the workers would keep going).
    resp = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
        stop=["Paris"])
    full12 = tokenizer.decode(fakes["decode"][0].tokens[:12])
    assert "Paris" in full12
    assert resp.choices[0].message.content == full12.split("Paris")[0]
    assert resp.choices[0].finish_reason == "stop"
    assert await wait_for(lambda: len(fakes["decode"][0].aborts) == 1)
    room = fakes["decode"][0].decode_requests[1].room
    assert fakes["decode"][0].aborts[0].room == room


async def test_n_fans_out_with_distinct_seeds(cluster):
    router, fakes = await cluster()
    resp = await _client(router).completions.create(model="tiny", prompt="hi", max_tokens=2,
                                                    n=3, seed=7)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    seeds = sorted(r.sampling.seed for r in fakes["decode"][0].decode_requests)
    assert seeds == [7, 8, 9]
    assert resp.usage.completion_tokens == 6
    assert len({r.room for r in fakes["decode"][0].decode_requests}) == 3


async def test_retry_once_before_first_token(cluster):
    # A generous health timeout: two slow health answers on a loaded machine would take the
    # decode worker out of rotation between the attempts, and the retry would find no pair.
    router, fakes = await cluster(num_prefill=2, prefill_policy="round_robin",
                                  health_check_timeout_s=5.0)
    # Both prefill workers healthy before the pick: otherwise `first` may be the only one
    # healthy yet while the router, a moment later, starts its round at the other.
    assert await wait_for(lambda: len(router.core.registry.available("prefill")) == 2)
    first = router.core.registry.available("prefill")[0].address  # round robin starts here
    bad = next(p for p in fakes["prefill"] if p.address == first)
    bad.fail_prefill = 1
    resp = await _client(router).completions.create(model="tiny", prompt="hi", max_tokens=3)
    assert resp.choices[0].finish_reason == "length"
    decode = fakes["decode"][0]
    assert len(decode.decode_requests) == 2
    rooms = [r.room for r in decode.decode_requests]
    assert rooms[0] != rooms[1]
    # the failed attempt's decode leg was aborted with its room
    assert await wait_for(lambda: any(a.room == rooms[0] for a in decode.aborts))
    assert all(len(p.prefill_requests) == 1 for p in fakes["prefill"])  # fresh pair


async def test_failure_after_retry_is_502(cluster):
    router, fakes = await cluster()
    fakes["decode"][0].fail_decode = 2
    async with httpx.AsyncClient() as http:
        r = await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                            json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "worker_failed"
    assert len(fakes["prefill"][0].prefill_requests) == 2
    assert await wait_for(lambda: len(fakes["prefill"][0].aborts) == 2)


async def test_mid_stream_failure_ends_with_error_event(cluster):
    router, fakes = await cluster(worker_kw={"fail_decode_after": 2})
    async with httpx.AsyncClient() as http:
        r = await http.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                            json={"prompt": "hi", "max_tokens": 6, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])
    assert len(fakes["decode"][0].decode_requests) == 1  # no retry after tokens went out


async def test_no_retry_of_a_request_a_worker_called_invalid(cluster):
    router, fakes = await cluster()
    decode = fakes["decode"][0]
    decode.fail_decode, decode.fail_code = 2, grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(openai.InternalServerError, match="INVALID_ARGUMENT"):
        await _client(router).completions.create(model="tiny", prompt="hi", max_tokens=3)
    assert len(decode.decode_requests) == 1


async def test_client_disconnect_aborts_both_legs(cluster):
    router, fakes = await cluster(worker_kw={"token_delay_s": 0.05})
    url = f"http://127.0.0.1:{router.http_port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 200, "stream": True}
    async with httpx.AsyncClient() as http, http.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
    p, d = fakes["prefill"][0], fakes["decode"][0]
    room = d.decode_requests[0].room
    assert await wait_for(lambda: p.aborts and d.aborts)
    assert p.aborts[0].room == room and d.aborts[0].room == room
    assert d.aborts[0].request_id == d.decode_requests[0].request_id
    assert await wait_for(lambda: d.decode_cancelled == 1)
    assert await wait_for(lambda: all(w.inflight == 0 for w in router.core.registry.all()))


async def test_client_disconnect_before_a_full_answer_aborts_both_legs(cluster):
    router, fakes = await cluster(worker_kw={"token_delay_s": 0.05})
    url = f"http://127.0.0.1:{router.http_port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 200}
    async with httpx.AsyncClient() as http:
        call = asyncio.ensure_future(http.post(url, json=body))
        d = fakes["decode"][0]
        assert await wait_for(lambda: d.decode_requests)
        await asyncio.sleep(0.3)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
    assert await wait_for(lambda: fakes["prefill"][0].aborts and d.aborts)
    assert await wait_for(lambda: d.decode_cancelled == 1)
    assert await wait_for(lambda: all(w.inflight == 0 for w in router.core.registry.all()))


async def test_mixed_only_pool(cluster, tokenizer):
    router, fakes = await cluster(num_prefill=0, num_decode=0, num_mixed=1)
    resp = await _client(router).completions.create(model="tiny", prompt="hi", max_tokens=3)
    m = fakes["mixed"][0]
    assert resp.choices[0].text == tokenizer.decode(m.tokens[:3])
    assert m.decode_requests[0].bootstrap_addr == "" and not m.prefill_requests


async def test_eos_finishes_with_stop(cluster, tokenizer):
    router, _ = await cluster(worker_kw={"tokens": [45, 46, 2, 47]})
    resp = await _client(router).completions.create(model="tiny", prompt="hi", max_tokens=10)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == tokenizer.decode([45, 46])
    assert resp.usage.completion_tokens == 3


async def test_models_workers_metrics_health(cluster):
    router, _ = await cluster()
    await _client(router).completions.create(model="tiny", prompt="hi", max_tokens=3)
    base = f"http://127.0.0.1:{router.http_port}"
    async with httpx.AsyncClient() as http:
        models = (await http.get(f"{base}/v1/models")).json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 4096
        assert (await http.get(f"{base}/health")).status_code == 200
        workers = (await http.get(f"{base}/workers")).json()["workers"]
        assert {w["role"] for w in workers} == {"prefill", "decode"}
        for w in workers:
            for key in ("address", "state", "kv_pages_total", "kv_pages_free", "kv_pages_cached",
                        "kv_pages_in_use", "num_running", "num_waiting"):
                assert key in w
            assert w["state"] == "healthy" and w["kv_pages_total"] == 100
        text = (await http.get(f"{base}/metrics")).text
    for name in ("pdserve_router_requests_total", "pdserve_router_ttft_seconds_bucket",
                 "pdserve_router_itl_seconds_bucket",
                 'pdserve_router_stage_seconds_count{stage="prefill"}',
                 "pdserve_worker_kv_pages_free", "pdserve_router_worker_healthy"):
        assert name in text, name
    assert 'endpoint="completions",status="200"' in text
