"""Overload and process lifetime on `pdserve up`.

- The default cluster (SmolLM2 on CPU) takes 256 concurrent streams: every one succeeds (the
  ones past decode's max_running wait with their rooms kept alive), no 5xx, every page back.
  Its router, SIGKILLed, is restarted by the launcher and serves; the launcher, SIGKILLed, takes
  every process, port and shared-memory segment of the cluster with it within 5 s.
- With a low --max-queued-requests the excess is refused with 429 at once (before any admitted
  stream ends; the seconds are printed) and the rest succeed; SIGHUP then drains the cluster
  and leaves nothing either.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import httpx
from fixtures.cluster import Cluster, start_cluster
from fixtures.footprint import Footprint, descendants

from pdserve.bench import refusal_burst

GONE_WITHIN_S = 5.0


@dataclass
class Outcome:
    status: int
    seconds: float  # until the status line (refusals) or the end of the stream
    finish: str | None = None
    error: str | None = None
    retry_after: str | None = None


async def _one(http: httpx.AsyncClient, i: int, max_tokens: int) -> Outcome:
    body = {"prompt": f"client {i}: the quick brown fox", "stream": True,
            "max_tokens": max_tokens, "temperature": 0.7, "ignore_eos": True}
    t0 = time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return Outcome(r.status_code, time.monotonic() - t0, error=text[:300],
                           retry_after=r.headers.get("retry-after"))
        out = Outcome(200, 0.0)
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                if "error" in obj:
                    out.error = obj["error"]["message"]
                for c in obj.get("choices", []):
                    out.finish = c.get("finish_reason") or out.finish
        out.seconds = time.monotonic() - t0
        return out


def burst(url: str, clients: int, max_tokens) -> list[Outcome]:  # type: ignore[no-untyped-def]
    """`clients` concurrent streaming completions, each `max_tokens(i)` tokens long."""
    async def run() -> list[Outcome]:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
            return await asyncio.gather(*(_one(http, i, max_tokens(i)) for i in range(clients)))
    return asyncio.run(run())


def _summary(outcomes: list[Outcome]) -> dict:
    return dict(collections.Counter((o.status, o.finish, o.error) for o in outcomes))


def _post_until_ok(url: str, timeout_s: float) -> float:
    """Seconds until a completion succeeds (a restarting router answers nothing, or 503)."""
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4}).encode()
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no completion succeeded within {timeout_s}s")


def _child(cluster: Cluster, role: str) -> int:
    for pid in descendants(cluster.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"pdserve" in argv and role.encode() in argv:
            return pid
    raise AssertionError(f"no {role} process under the launcher")


def _kill_all(fp: Footprint) -> None:
    for pid in fp.pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_default_cluster_256_streams_router_restart_and_sigkill(smollm2_path):
    cluster = start_cluster(smollm2_path)
    fp = Footprint.of(cluster.proc.pid)
    try:
        t0 = time.monotonic()
        outcomes = burst(cluster.url, 256, lambda i: 4 + i % 5)
        wall = time.monotonic() - t0
        ok = [o for o in outcomes if o.status == 200 and o.finish == "length" and not o.error]
        assert len(ok) == 256, _summary(outcomes)
        workers = cluster.wait_idle(60)
        assert all(w["kv_pages_in_use"] == 0 for w in workers), workers
        result = {"clients": 256, "wall_s": round(wall, 1),
                  "slowest_s": round(max(o.seconds for o in ok), 1)}
        print(f"overload-result {json.dumps(result)}")
        # The router dies: the launcher starts it again on the same port, workers stay up.
        worker_pids = {_child(cluster, "prefill"), _child(cluster, "decode")}
        os.kill(_child(cluster, "router"), signal.SIGKILL)
        _post_until_ok(cluster.url, 120)
        assert "restarting it" in "".join(cluster.log)
        assert {_child(cluster, "prefill"), _child(cluster, "decode")} == worker_pids
        # The launcher dies: nothing of the cluster outlives it.
        fp = Footprint.of(cluster.proc.pid)
        assert fp.shm and len(fp.ports) >= 4, fp  # a pool; HTTP, gRPC x3, KV bootstrap...
        cluster.proc.kill()
        cluster.proc.wait()
        print(f"sigkill-gone-s {fp.wait_gone(GONE_WITHIN_S):.2f}")
    finally:
        _kill_all(fp)


def test_queue_bound_refuses_at_once_then_sighup_leaves_nothing(smollm2_path):
    cluster = start_cluster(smollm2_path, router_args=("--max-queued-requests=8",))
    fp = Footprint.of(cluster.proc.pid)
    try:
        outcomes = burst(cluster.url, 256, lambda i: 32)
        refused = sorted((o for o in outcomes if o.status == 429), key=lambda o: o.seconds)
        ok = [o for o in outcomes if o.status == 200 and o.finish == "length" and not o.error]
        assert refused and len(ok) + len(refused) == 256, _summary(outcomes)
        assert len(ok) >= 64 + 8  # decode's running slots and the queue were all used
        assert all(o.retry_after and '"queue_full"' in (o.error or "") for o in refused)
        # Refused at once: before any admitted stream ended (how fast in seconds is this
        # machine's business: the figure is in docs/reliability.md, measured on a quiet one).
        first_done = min(o.seconds for o in ok)
        assert refused[-1].seconds < first_done, (refused[-1], first_done)
        result = {"refused": len(refused), "served": len(ok),
                  "refused_p50_s": round(refused[len(refused) // 2].seconds, 2),
                  "refused_max_s": round(refused[-1].seconds, 2),
                  "first_served_s": round(first_done, 2)}
        print(f"refused-result {json.dumps(result)}")
        workers = cluster.wait_idle(60)
        assert all(w["kv_pages_in_use"] == 0 for w in workers), workers
        # The same burst from raw sockets (the router's pace, not an HTTP library's).
        raw = asyncio.run(refusal_burst.burst(cluster.url, 256, 32))
        print(f"refused-raw-result {json.dumps(raw)}")
        assert raw["other"] == [] and raw["refused"] + raw["served"] == 256, raw
        assert raw["served"] >= 64 + 8 and raw["refused_max_s"] < raw["first_served_s"], raw
        workers = cluster.wait_idle(60)
        assert all(w["kv_pages_in_use"] == 0 for w in workers), workers
        fp = Footprint.of(cluster.proc.pid)
        cluster.proc.send_signal(signal.SIGHUP)  # drains like SIGTERM
        assert cluster.proc.wait(GONE_WITHIN_S) == 0
        print(f"sighup-gone-s {fp.wait_gone(GONE_WITHIN_S):.2f}")
    finally:
        _kill_all(fp)
