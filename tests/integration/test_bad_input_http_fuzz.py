"""Property test of the HTTP gateway: whatever a client sends, the answer is 200 or the right
4xx with an OpenAI-shaped error body; never a 500, never a stack trace. Workers are the
deterministic gRPC doubles of test_router_fakes (fast), the router is real."""
# ruff: noqa: F811  (pytest fixtures imported from test_router_fakes)

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_router_fakes import cluster, tokenizer  # noqa: F401 (fixtures)

ROUTES = ["/v1/completions", "/v1/chat/completions"]
KEYS = ["prompt", "messages", "model", "max_tokens", "temperature", "top_p", "top_k", "n",
        "stream", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty",
        "frequency_penalty", "ignore_eos", "min_tokens", "max_completion_tokens", "user",
        "stream_options", "echo", "best_of", "logit_bias", "response_format", "tools"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10)
message = st.fixed_dictionaries({"role": st.sampled_from(
    ["user", "system", "assistant", "tool", "robot", "", None]), "content": values})
bodies = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), values, max_size=6),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=40), st.lists(
        st.integers(-5, 100_000), max_size=8))},
        optional={k: values for k in KEYS[2:12]}),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=3)},
                          optional={k: values for k in KEYS[2:12]}),
    values,
)
raw = st.one_of(st.binary(max_size=64), st.sampled_from([
    b"", b"{", b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b"NaN", b'{"prompt": NaN}',
    b'{"prompt": "hi", "max_tokens": Infinity}', b"[]" * 10, b'"prompt"']))

ALLOWED = {200, 400, 401, 404, 413, 422, 503}


def _check(r: httpx.Response, stream: bool) -> None:
    assert r.status_code in ALLOWED, (r.status_code, r.text[:500])
    assert "Traceback" not in r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    elif not stream:
        assert "choices" in r.json()


async def test_http_api_fuzz(cluster):
    router, _ = await cluster(worker_kw={"max_context_len": 256})
    base = f"http://127.0.0.1:{router.http_port}"

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(route=st.sampled_from(ROUTES), body=bodies)
    def json_bodies(route: str, body) -> None:
        stream = isinstance(body, dict) and body.get("stream") is True
        with httpx.Client(base_url=base, timeout=60) as http:
            r = http.post(route, content=json.dumps(body),
                          headers={"Content-Type": "application/json"})
            if stream and r.status_code == 200:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
            else:
                _check(r, stream)

    @settings(max_examples=60, deadline=None, database=None)
    @given(route=st.sampled_from(ROUTES + ["/v1/nope", "/v1/models"]), body=raw)
    def raw_bodies(route: str, body: bytes) -> None:
        with httpx.Client(base_url=base, timeout=60) as http:
            r = http.post(route, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code in {400, 404, 405}, (r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}

    await asyncio.to_thread(json_bodies)
    await asyncio.to_thread(raw_bodies)
