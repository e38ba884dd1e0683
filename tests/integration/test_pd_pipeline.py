"""The product end to end: openai client -> router -> prefill -> KV pages -> decode -> client.

Real processes on loopback (pdserve up), real gRPC, the real SmolLM2 model; greedy output must
equal HF transformers' greedy output token for token (compared as text through the same
tokenizer).
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from fixtures.cluster import start_cluster
from fixtures.hf_ref import hf_greedy, hf_model

openai = pytest.importorskip("openai")

PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "Water boils at",
    ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "Repeat after me: the quick brown fox"),
]


@pytest.fixture(scope="module")
def pd_cluster(smollm2_path):
    # A small prefill chunk makes longer prompts ship their KV in several chunks.
    c = start_cluster(smollm2_path, prefill=1, decode=1,
                      worker_args=("--chunked-prefill-size=32", "--max-running=48"))
    yield c
    assert c.stop() == 0, "".join(c.log[-30:])


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0)


def _model(cluster) -> str:
    return cluster.get("/v1/models")["data"][0]["id"]


def _hf_text(path: str, prompt: str, max_tokens: int, chat: bool = False) -> str:
    _, tok = hf_model(path)
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        ids = tok.encode(prompt)
    return tok.decode(hf_greedy(path, ids, max_tokens), skip_special_tokens=True)


def test_completions_equal_hf_greedy(pd_cluster, smollm2_path):
    client, model = _client(pd_cluster), _model(pd_cluster)
    for prompt in PROMPTS[:3]:
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                         temperature=0)
        assert resp.choices[0].text == _hf_text(smollm2_path, prompt, 16), prompt
        assert resp.usage.completion_tokens >= 1


def test_streamed_completion_equals_unstreamed(pd_cluster):
    client, model = _client(pd_cluster), _model(pd_cluster)
    prompt = PROMPTS[2]
    full = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                     temperature=0).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == full and len(parts) > 1


def test_chat_equals_hf_greedy_streamed_and_not(pd_cluster, smollm2_path):
    client, model = _client(pd_cluster), _model(pd_cluster)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    expected = _hf_text(smollm2_path, msgs[0]["content"], 20, chat=True)
    resp = client.chat.completions.create(model=model, messages=msgs, max_tokens=20,
                                          temperature=0)
    assert resp.choices[0].message.content == expected
    assert "Paris" in expected
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=20,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected


def test_32_concurrent_mixed_lengths(pd_cluster, smollm2_path):
    client, model = _client(pd_cluster), _model(pd_cluster)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) + str(i) for i in range(32)]
    lens = [4 + (i * 7) % 13 for i in range(32)]

    def one(i: int) -> str:
        return client.completions.create(model=model, prompt=prompts[i], max_tokens=lens[i],
                                         temperature=0).choices[0].text

    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    for i in range(32):
        assert got[i] == _hf_text(smollm2_path, prompts[i], lens[i]), i
    workers = pd_cluster.wait_idle()
    assert all(w["kv_pages_in_use"] == 0 for w in workers), workers


def test_repeated_long_prefix_hits_prefill_radix_cache(pd_cluster):
    client, model = _client(pd_cluster), _model(pd_cluster)
    system = "You are a careful assistant who answers briefly. " * 12
    first = client.completions.create(model=model, prompt=system + "Question one?",
                                      max_tokens=4, temperature=0)
    second = client.completions.create(model=model, prompt=system + "Question two?",
                                       max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64, cached
    workers = pd_cluster.wait_idle()
    assert all(w["kv_pages_in_use"] == 0 for w in workers), workers
    prefill = [w for w in workers if w["role"] == "prefill"]
    assert prefill and prefill[0]["kv_pages_cached"] > 0


def test_stage_timings_cover_prefill_transfer_and_decode(pd_cluster):
    import json
    import urllib.request

    body = json.dumps({"model": _model(pd_cluster), "prompt": PROMPTS[2], "max_tokens": 6,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{pd_cluster.url}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        timings = json.load(resp)["pdserve"]["choices"][0]["timings"]
    for stage in ("prefill_ms", "transfer_ms", "decode_ms", "ttft_ms"):
        assert timings[stage] > 0, timings
