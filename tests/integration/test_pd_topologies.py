"""Topologies: the colocated `mixed` baseline gives the same greedy output and logprobs as P/D
(the first token's top logprobs included, which travel from prefill to decode in the KV
transfer's aux data), and `pdserve up --prefill 2 --decode 2` spreads requests over all four
workers."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.request

from fixtures.cluster import Cluster, start_cluster

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "The three primary colors are",
    "def add(a, b):",
    "Once upon a time",
    "The largest planet in the solar system is",
]


def _post(cluster: Cluster, route: str, body: dict) -> dict:
    body = {"model": cluster.get("/v1/models")["data"][0]["id"], "temperature": 0, **body}
    req = urllib.request.Request(f"{cluster.url}{route}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)


def _complete(cluster: Cluster, prompt: str, max_tokens: int = 12) -> dict:
    return _post(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})


def _logprob_answers(cluster: Cluster) -> tuple[dict, list[dict]]:
    """A completion with logprobs=3 and a chat completion with top_logprobs=3, 6 tokens each."""
    cmpl = _post(cluster, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6,
                                              "logprobs": 3, "ignore_eos": True})
    chat = _post(cluster, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 6,
        "logprobs": True, "top_logprobs": 3})
    return cmpl["choices"][0]["logprobs"], chat["choices"][0]["logprobs"]["content"]


def _assert_same_logprobs(pd: tuple[dict, list[dict]], mixed: tuple[dict, list[dict]]) -> None:
    (pd_cmpl, pd_chat), (mx_cmpl, mx_chat) = pd, mixed
    assert pd_cmpl["tokens"] == mx_cmpl["tokens"] and len(pd_cmpl["tokens"]) == 6
    # every token has its top 3, the first one (sampled on the prefill worker) included
    assert [len(t) for t in pd_cmpl["top_logprobs"]] == [3] * 6
    for a, b in zip(pd_cmpl["top_logprobs"], mx_cmpl["top_logprobs"]):
        assert list(a) == list(b)
        assert all(abs(a[k] - b[k]) < 1e-4 for k in a)
    for a, b in zip(pd_cmpl["token_logprobs"], mx_cmpl["token_logprobs"]):
        assert abs(a - b) < 1e-4
    assert [t["token"] for t in pd_chat] == [t["token"] for t in mx_chat]
    assert [len(t["top_logprobs"]) for t in pd_chat] == [3] * len(pd_chat)
    for a, b in zip(pd_chat, mx_chat):
        assert [x["token"] for x in a["top_logprobs"]] == [x["token"] for x in b["top_logprobs"]]
        assert abs(a["logprob"] - b["logprob"]) < 1e-4


def _texts(cluster: Cluster) -> list[str]:
    with cf.ThreadPoolExecutor(4) as pool:
        return [r["choices"][0]["text"] for r in pool.map(lambda p: _complete(cluster, p),
                                                          PROMPTS)]


def test_mixed_and_pd_give_identical_greedy_output_and_logprobs(smollm2_path):
    mixed = start_cluster(smollm2_path, prefill=0, decode=0, mixed=1)
    try:
        mixed_texts = _texts(mixed)
        mixed_lps = _logprob_answers(mixed)
        assert all(w["role"] == "mixed" for w in mixed.workers())
    finally:
        assert mixed.stop() == 0
    pd = start_cluster(smollm2_path, prefill=1, decode=1)
    try:
        pd_texts = _texts(pd)
        pd_lps = _logprob_answers(pd)
    finally:
        assert pd.stop() == 0
    assert pd_texts == mixed_texts
    _assert_same_logprobs(pd_lps, mixed_lps)
    assert any("Paris" in t for t in pd_texts)


def test_two_by_two_spreads_requests_over_all_workers(smollm2_path):
    cluster = start_cluster(smollm2_path, prefill=2, decode=2)
    try:
        workers = cluster.workers()
        assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill", "prefill"]
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(12)]
        with cf.ThreadPoolExecutor(6) as pool:
            resps = list(pool.map(lambda p: _complete(cluster, p, 4), prompts))
        used_p = {r["pdserve"]["choices"][0]["prefill_worker"] for r in resps}
        used_d = {r["pdserve"]["choices"][0]["decode_worker"] for r in resps}
        by_role = {role: {w["address"] for w in workers if w["role"] == role}
                   for role in ("prefill", "decode")}
        assert used_p == by_role["prefill"] and used_d == by_role["decode"]
        assert all(w["kv_pages_in_use"] == 0 for w in cluster.wait_idle())
    finally:
        assert cluster.stop() == 0
