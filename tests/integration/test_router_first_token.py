"""The first token streams from the prefill answer, before decode has the KV; decode's copy of
it is skipped, and a decode failure after only that token continues from it on a fresh pair."""
# ruff: noqa: F811  (pytest fixtures imported from test_router_fakes)

from __future__ import annotations

import json
import time

import httpx
from test_router_fakes import cluster, tokenizer, wait_for  # noqa: F401 (fixtures)


async def _stream(router, **body) -> tuple[list[dict], float]:  # noqa: ANN001
    """The SSE events of one streamed completion, and seconds to the first text."""
    t0, first = time.monotonic(), None
    events = []
    async with httpx.AsyncClient(timeout=30) as http, http.stream(
            "POST", f"http://127.0.0.1:{router.http_port}/v1/completions",
            json={"prompt": "hi", "stream": True, **body}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices") and ev["choices"][0].get("text"):
                first = time.monotonic() - t0
            events.append(ev)
    return events, first


def _text(events: list[dict]) -> str:
    return "".join(c.get("text", "") for e in events for c in e.get("choices", []))


async def test_the_first_token_comes_from_the_prefill_answer_once(cluster, tokenizer):
    # Decode's tokens come 0.4 s apart, its first one too: the first text arrives well before.
    router, fakes = await cluster(worker_kw={"token_delay_s": 0.4})
    ids = fakes["decode"][0].tokens
    events, first = await _stream(router, max_tokens=3, logprobs=1)
    assert first is not None and first < 0.3, first
    assert _text(events) == tokenizer.decode(ids[:3])  # the first token once, not twice
    lps = [lp for e in events for c in e.get("choices", []) if c.get("logprobs")
           for lp in c["logprobs"]["token_logprobs"]]
    assert lps == [-0.5] * 3
    usage = [e["usage"] for e in events if e.get("usage")]
    assert not usage or usage[-1]["completion_tokens"] == 3


async def test_a_decode_failure_after_the_first_token_continues_from_it(cluster, tokenizer):
    router, fakes = await cluster(num_prefill=2, num_decode=2, health_check_timeout_s=5.0)
    assert await wait_for(lambda: len(router.core.registry.available("decode")) == 2)
    assert await wait_for(lambda: len(router.core.registry.available("prefill")) == 2)
    first = router.core.registry.available("decode")[0].address  # round robin starts here
    bad = next(d for d in fakes["decode"] if d.address == first)
    good = next(d for d in fakes["decode"] if d is not bad)
    bad.fail_decode_after = 0  # fails once its room's prefill answered, before any token
    bad.token_delay_s = 0.2  # ... a moment after: the prefill's token is out by then
    events, _ = await _stream(router, max_tokens=5, min_tokens=2, ignore_eos=True)
    ids = bad.tokens
    assert _text(events) == tokenizer.decode(ids[:5])
    assert not any("error" in e for e in events)
    prompt = list(bad.decode_requests[0].input_ids)
    cont = good.decode_requests[-1]
    assert list(cont.input_ids) == prompt + [ids[0]]  # the prompt and the streamed token
    assert cont.sampling.max_tokens == 4 and cont.sampling.min_tokens == 1
    assert cont.room != bad.decode_requests[0].room
    assert await wait_for(lambda: any(a.room == bad.decode_requests[0].room for a in bad.aborts))


async def test_no_continuation_where_penalties_count_the_output(cluster):
    router, fakes = await cluster(num_prefill=2, num_decode=2, health_check_timeout_s=5.0)
    assert await wait_for(lambda: len(router.core.registry.available("decode")) == 2)
    for d in fakes["decode"]:
        d.fail_decode_after, d.token_delay_s = 0, 0.2
    events, _ = await _stream(router, max_tokens=5, frequency_penalty=0.5)
    assert _text(events)  # the first token went out ...
    assert "error" in events[-1]  # ... and the failure ends the stream
    assert sum(len(d.decode_requests) for d in fakes["decode"]) == 1
