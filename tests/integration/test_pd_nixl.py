"""A served P/D request whose KV moves over the nixl backend (real NIXL agents, one-sided WRITEs
into decode's registered pool) gives HF transformers' greedy output on SmolLM2, in chunks, and
`/workers` shows the backend each worker offers."""

from __future__ import annotations

import json
import urllib.request

import pytest
from fixtures.cluster import start_cluster
from fixtures.hf_ref import hf_greedy, hf_model

from pdserve.kvtransfer.backends import importable

pytestmark = pytest.mark.skipif(not importable("nixl"), reason="nixl is not installed")

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def test_pd_over_nixl_equals_hf_greedy(smollm2_path: str) -> None:
    # A small prefill chunk: the longer prompt's KV leaves in several WRITEs. A small pool:
    # a host pool outside shared memory is zeroed up front.
    cluster = start_cluster(smollm2_path, prefill=1, decode=1,
                            worker_args=("--transfer-backend=nixl", "--chunked-prefill-size=8",
                                         "--num-pages=256"))
    try:
        workers = cluster.workers()
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
        assert all(w["transfer_backends"] == ["nixl"] for w in workers), workers
        model = cluster.get("/v1/models")["data"][0]["id"]
        _, tok = hf_model(smollm2_path)
        for prompt in PROMPTS:
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 12,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"{cluster.url}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as resp:
                text = json.load(resp)["choices"][0]["text"]
            expected = tok.decode(hf_greedy(smollm2_path, tok.encode(prompt), 12),
                                  skip_special_tokens=True)
            assert text == expected, prompt
        assert all(w["kv_pages_in_use"] == 0 for w in cluster.wait_idle())
    finally:
        assert cluster.stop() == 0, "".join(cluster.log[-30:])
