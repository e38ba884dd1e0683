"""A bounded soak: many concurrent streaming clients on CPU (loopback).

No errors, stable memory in every process, zero pages in use afterwards. `make test` runs a
short version against a tiny model (router + workers as separate processes); `make soak` the
long one against the default cluster, `pdserve up` with SmolLM2 and its default flags
(PDSERVE_SOAK=1; knobs PDSERVE_SOAK_SECONDS, PDSERVE_SOAK_CLIENTS), and measures how soon the
workers register with a router restarted after a 60 s outage. Each run prints a
`soak-result {json}` (or `outage-result {json}`) line with the figures docs/reliability.md
records.
"""
# ruff: noqa: F811  (pytest fixtures imported from test_faults_procs)

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from fixtures.cluster import start_cluster
from fixtures.footprint import descendants, shm_names
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


def _shm_limit_mib(pid: int) -> float:
    """How much shared memory the process can have resident: the segments it maps."""
    total = 0
    for name in shm_names([pid]):
        try:
            total += os.stat(f"/dev/shm/{name}").st_size
        except OSError:
            pass
    return total / 2**20


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


def _soak(url: str, pids: dict[str, int], wait_idle, clients: int, seconds: float,
          warmup_s: float) -> dict:  # type: ignore[no-untyped-def]
    asyncio.run(_load(url, clients, warmup_s))  # allocator pools, caches, JIT warm
    rss_before = {name: round(_rss_mib(pid), 1) for name, pid in pids.items()}
    anon_before = {name: round(_private_mib(pid), 1) for name, pid in pids.items()}
    shm_limit = {name: round(_shm_limit_mib(pid), 1) for name, pid in pids.items()}
    t0 = time.monotonic()
    # Two halves: a leak grows in both, while allocators and caches that are still settling
    # after the warm-up (glibc arenas for SmolLM2's larger batches moved decode's private memory
    # by up to ~190 MiB) stop growing; the second half is held to the flat bound.
    stats = asyncio.run(_load(url, clients, seconds / 2))
    anon_mid = {name: round(_private_mib(pid), 1) for name, pid in pids.items()}
    second = asyncio.run(_load(url, clients, seconds / 2))
    stats = {"requests": stats["requests"] + second["requests"],
             "errors": stats["errors"] + second["errors"]}
    duration = time.monotonic() - t0
    idle = wait_idle(120)
    rss_after = {name: round(_rss_mib(pid), 1) for name, pid in pids.items()}
    anon_after = {name: round(_private_mib(pid), 1) for name, pid in pids.items()}
    shm_after = {name: round(_rss_mib(pid, "RssShmem"), 1) for name, pid in pids.items()}
    result = {"clients": clients, "duration_s": round(duration, 1),
              "requests": stats["requests"], "errors": len(stats["errors"]),
              "rss_before_mib": rss_before, "rss_after_mib": rss_after,
              "anon_before_mib": anon_before, "anon_mid_mib": anon_mid,
              "anon_after_mib": anon_after,
              "shm_resident_after_mib": shm_after, "shm_mapped_mib": shm_limit,
              "kv_pages_in_use_after": {w["role"]: w["kv_pages_in_use"] for w in idle}}
    print("soak-result " + json.dumps(result), flush=True)
    assert not stats["errors"], stats["errors"][:10]
    assert stats["requests"] >= clients
    assert all(w["kv_pages_in_use"] == 0 for w in idle), idle
    for name, mid in anon_mid.items():  # private memory: flat over the second half
        assert anon_after[name] <= mid * 1.05 + 16, (name, mid, anon_after[name])
    for name, limit in shm_limit.items():  # shared: at most the KV pool it maps
        assert shm_after[name] <= limit + 16, (name, limit, shm_after[name])
    return result


def test_short_soak(procs):
    # The router's default health/lease timing (the fault tests shorten it).
    router = procs.start_router("--health-check-interval=2", "--heartbeat-interval=2",
                                "--lease=10")
    workers = procs.start_workers("prefill", "decode")
    procs.wait_healthy(2)
    pids = {p.name: p.popen.pid for p in (router, *workers)}
    _soak(procs.url, pids, procs.wait_idle, clients=48, seconds=10, warmup_s=3)


def _roles(launcher: int) -> dict[str, int]:
    """The pid of each `pdserve <role>` process under the launcher."""
    pids = {}
    for pid in descendants(launcher):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if argv[1:4] in ([b"-m", b"pdserve", r.encode()] for r in ("router", "prefill", "decode")):
            pids[argv[3].decode()] = pid
    assert set(pids) == {"router", "prefill", "decode"}, pids
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not envs().soak, reason="long soak: make soak")
def test_long_soak(smollm2_path):
    cluster = start_cluster(smollm2_path)
    try:
        _soak(cluster.url, _roles(cluster.proc.pid), cluster.wait_idle,
              clients=envs().soak_clients, seconds=envs().soak_seconds, warmup_s=60)
    except BaseException:
        print("".join(cluster.log[-60:]))
        raise
    finally:
        assert cluster.stop() == 0


@pytest.mark.slow
@pytest.mark.skipif(not envs().soak, reason="long soak: make soak")
def test_reregistration_after_a_60s_router_outage(procs):
    procs.start_router()
    procs.start_workers("prefill", "decode")
    procs.wait_healthy(2)
    grpc_port = int(procs.grpc_addr.rpartition(":")[2])
    assert procs.router is not None
    procs.router.signal(signal.SIGKILL)
    killed = time.monotonic()
    time.sleep(60.0)
    procs.start_router(grpc_port=grpc_port)
    ready = time.monotonic()
    while sum(w["state"] == "healthy" for w in procs.workers()) < 2:
        time.sleep(0.02)
    result = {"outage_s": round(ready - killed, 1),
              "reregistered_s": round(time.monotonic() - ready, 2)}
    print("outage-result " + json.dumps(result), flush=True)
    assert result["reregistered_s"] < 2.0
