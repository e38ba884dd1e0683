"""A bounded soak: many concurrent streaming clients against a tiny model on CPU (loopback).

No errors, stable memory in every process, zero pages in use afterwards. `make test` runs a
short version; `make soak` the long one (PDSERVE_SOAK=1; knobs PDSERVE_SOAK_SECONDS,
PDSERVE_SOAK_CLIENTS). Each run prints a `soak-result {json}` line with the figures that
docs/reliability.md records.
"""
# ruff: noqa: F811  (pytest fixtures imported from test_faults_procs)

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from test_faults_procs import procs  # noqa: F401 (fixture)

from pdserve.envs import envs


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _private_mib(pid: int) -> float:
    """Anonymous (private) memory. RSS also counts the shared-memory KV pool, which decode and
    the prefill writing into it touch page by page until it is all resident: bounded by the
    pool's size, not a leak, so stability is judged on this."""
    return _rss_mib(pid, "RssAnon")


async def _client(http: httpx.AsyncClient, i: int, deadline: float, stats: dict) -> None:
    n = 0
    while time.monotonic() < deadline:
        body = {"prompt": f"client {i} request {n}: the quick brown fox", "stream": True,
                "max_tokens": 8 + (i + n) % 24, "temperature": 0.7, "ignore_eos": True}
        n += 1
        try:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    stats["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    continue
                finish = None
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            stats["errors"].append(obj["error"]["message"])
                        for c in obj.get("choices", []):
                            finish = c.get("finish_reason") or finish
                if finish != "length":
                    stats["errors"].append(f"finish_reason {finish!r}")
                else:
                    stats["requests"] += 1
        except httpx.HTTPError as e:
            stats["errors"].append(f"transport: {e!r}")


async def _load(url: str, clients: int, seconds: float) -> dict:
    stats: dict = {"requests": 0, "errors": []}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_client(http, i, deadline, stats) for i in range(clients)))
    return stats


def _soak(procs, clients: int, seconds: float, warmup_s: float) -> dict:
    # The router's default health/lease timing (the fault tests shorten it).
    router = procs.start_router("--health-check-interval=2", "--heartbeat-interval=2",
                                "--lease=10")
    workers = procs.start_workers("prefill", "decode", args=("--max-running=256",))
    procs.wait_healthy(2)
    every = [router, *workers]
    asyncio.run(_load(procs.url, clients, warmup_s))  # allocator pools, caches, JIT warm
    rss_before = {p.name: round(_rss_mib(p.popen.pid), 1) for p in every}
    anon_before = {p.name: round(_private_mib(p.popen.pid), 1) for p in every}
    t0 = time.monotonic()
    stats = asyncio.run(_load(procs.url, clients, seconds))
    duration = time.monotonic() - t0
    idle = procs.wait_idle(120)
    rss_after = {p.name: round(_rss_mib(p.popen.pid), 1) for p in every}
    anon_after = {p.name: round(_private_mib(p.popen.pid), 1) for p in every}
    result = {"clients": clients, "duration_s": round(duration, 1),
              "requests": stats["requests"], "errors": len(stats["errors"]),
              "rss_before_mib": rss_before, "rss_after_mib": rss_after,
              "anon_before_mib": anon_before, "anon_after_mib": anon_after,
              "kv_pages_in_use_after": {w["role"]: w["kv_pages_in_use"] for w in idle}}
    print("soak-result " + json.dumps(result), flush=True)
    assert not stats["errors"], (stats["errors"][:10], procs.logs())
    assert stats["requests"] >= clients
    for name, before in anon_before.items():  # private memory: flat
        assert anon_after[name] <= before * 1.05 + 16, (name, before, anon_after[name])
    for name, before in rss_before.items():  # all of it: + at most the touched KV pool
        assert rss_after[name] <= before * 1.25 + 64, (name, before, rss_after[name])
    return result


def test_short_soak(procs):
    _soak(procs, clients=48, seconds=10, warmup_s=3)


@pytest.mark.slow
@pytest.mark.skipif(not envs().soak, reason="long soak: make soak")
def test_long_soak(procs):
    _soak(procs, clients=envs().soak_clients, seconds=envs().soak_seconds, warmup_s=15)
