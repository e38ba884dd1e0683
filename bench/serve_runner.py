"""`pdserve bench` run loop: warm-up, arrivals (gamma / Poisson or back to back under a
concurrency cap), a /workers poller for queue depth, /metrics snapshots, a progress bar."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from pdserve.bench.serve_client import RequestResult
from pdserve.bench.serve_config import BenchConfig
from pdserve.bench.serve_workload import BenchRequest


class BenchClient(Protocol):
    async def send(self, req: BenchRequest, res: RequestResult) -> None: ...


@dataclass
class QueueSample:
    t_s: float  # seconds since the run began
    depth: dict[str, int]  # role -> sum of num_waiting + num_running over its workers
    running: dict[str, int] = field(default_factory=dict)  # role -> sum of num_running


@dataclass
class RunOutcome:
    results: list[RequestResult]
    duration_s: float
    queue: list[QueueSample] = field(default_factory=list)
    metrics_before: str = ""
    metrics_after: str = ""


def arrival_gaps(cfg: BenchConfig, n: int) -> Iterator[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/rate); shape 1 is a
    Poisson process. An infinite rate sends everything at once."""
    rng = random.Random(cfg.seed + 1)
    for _ in range(n):
        if math.isinf(cfg.request_rate):
            yield 0.0
        else:
            theta = 1.0 / (cfg.request_rate * cfg.burstiness)
            yield rng.gammavariate(cfg.burstiness, theta)


class _Progress:
    """tqdm on stderr when asked for; a no-op otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def fetch_text(http: httpx.AsyncClient, path: str) -> str:
    try:
        resp = await http.get(path, timeout=5.0)
        return resp.text if resp.status_code == 200 else ""
    except (httpx.HTTPError, OSError):
        return ""


async def resolve_model(http: httpx.AsyncClient, model: str | None) -> str:
    """The asked-for model, else the first id the router lists."""
    if model is not None:
        return model
    resp = await http.get("/v1/models", timeout=10.0)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError("model: the router lists no models; pass --model")
    return str(data[0]["id"])


async def _poll_workers(http: httpx.AsyncClient, t0: float, interval_s: float,
                        out: list[QueueSample]) -> None:
    while True:
        try:
            resp = await http.get("/workers", timeout=5.0)
            depth: dict[str, int] = {}
            running: dict[str, int] = {}
            for w in resp.json().get("workers", []):
                role = str(w.get("role", "?"))
                n = int(w.get("num_running", 0))
                depth[role] = depth.get(role, 0) + n + int(w.get("num_waiting", 0))
                running[role] = running.get(role, 0) + n
            out.append(QueueSample(time.perf_counter() - t0, depth, running))
        except (httpx.HTTPError, OSError, ValueError, AttributeError):
            pass  # a missed sample is fine; the run goes on
        await asyncio.sleep(interval_s)


async def _send_all(client: BenchClient, reqs: list[BenchRequest], cfg: BenchConfig,
                    t0: float, gaps: bool, progress: _Progress | None) -> list[RequestResult]:
    sem = asyncio.Semaphore(cfg.max_concurrency or len(reqs) or 1)
    results = [RequestResult(r.input_len, r.output_len) for r in reqs]

    async def one(i: int) -> None:
        async with sem:
            results[i].start_s = time.perf_counter() - t0
            try:
                await client.send(reqs[i], results[i])
            except Exception as e:  # noqa: BLE001 - a failed request is data, not a crash
                results[i].error = f"{type(e).__name__}: {e}"[:200]
        if progress is not None:
            progress.update()

    tasks = []
    delays = arrival_gaps(cfg, len(reqs)) if gaps else iter([0.0] * len(reqs))
    for i, delay in enumerate(delays):
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return results


async def run_bench(cfg: BenchConfig, client: BenchClient, warmup: list[BenchRequest],
                    measured: list[BenchRequest], http: httpx.AsyncClient) -> RunOutcome:
    """Warm-up (not measured), then the measured requests; `http` reaches the router's HTTP
    side for /workers and /metrics whichever protocol the requests use."""
    if warmup:
        await _send_all(client, warmup, cfg, time.perf_counter(), gaps=False, progress=None)
    before = await fetch_text(http, "/metrics")
    queue: list[QueueSample] = []
    t0 = time.perf_counter()
    poller = asyncio.create_task(_poll_workers(http, t0, cfg.poll_interval_s, queue))
    progress = _Progress(len(measured), cfg.progress)
    try:
        results = await _send_all(client, measured, cfg, t0, gaps=True, progress=progress)
        duration = time.perf_counter() - t0
    finally:
        progress.close()
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    after = await fetch_text(http, "/metrics")
    return RunOutcome(results, duration, queue, before, after)
