"""Topologies: the colocated `mixed` baseline gives the same greedy output as P/D, and
`pdserve up --prefill 2 --decode 2` spreads requests over all four workers."""

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


def _complete(cluster: Cluster, prompt: str, max_tokens: int = 12) -> dict:
    model = cluster.get("/v1/models")["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{cluster.url}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)


def _texts(cluster: Cluster) -> list[str]:
    with cf.ThreadPoolExecutor(4) as pool:
        return [r["choices"][0]["text"] for r in pool.map(lambda p: _complete(cluster, p),
                                                          PROMPTS)]


def test_mixed_and_pd_give_identical_greedy_output(smollm2_path):
    mixed = start_cluster(smollm2_path, prefill=0, decode=0, mixed=1)
    try:
        mixed_texts = _texts(mixed)
        assert all(w["role"] == "mixed" for w in mixed.workers())
    finally:
        assert mixed.stop() == 0
    pd = start_cluster(smollm2_path, prefill=1, decode=1)
    try:
        pd_texts = _texts(pd)
    finally:
        assert pd.stop() == 0
    assert pd_texts == mixed_texts
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
