"""Prometheus metrics of one router (its own CollectorRegistry: two routers never share)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.router.disagg import DisaggDecision
from pdserve.router.events import TIMING_FIELDS, Usage
from pdserve.router.registry import SERVING_ROLES, Registry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_LOAD_FIELDS = ("num_running", "num_waiting", "num_inflight", "kv_pages_total", "kv_pages_free",
                "kv_pages_cached", "kv_pages_in_use", "max_running")


class _WorkerCollector(Collector):
    """Worker gauges read from the registry at scrape time (no copies to keep in sync)."""

    def __init__(self, workers: Callable[[], Registry | None]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        registry = self._workers()
        entries = registry.all() if registry is not None else []
        up = GaugeMetricFamily("pdserve_router_worker_healthy",
                               "1 when the worker is in rotation", labels=["address", "role"])
        inflight = GaugeMetricFamily("pdserve_router_worker_inflight",
                                     "requests this router has on the worker",
                                     labels=["address", "role"])
        loads = {f: GaugeMetricFamily(f"pdserve_worker_{f}", f"worker-reported {f}",
                                      labels=["address", "role"]) for f in _LOAD_FIELDS}
        for w in entries:
            labels = [w.address, w.role]
            up.add_metric(labels, 1.0 if w.state == "healthy" else 0.0)
            inflight.add_metric(labels, float(w.inflight))
            for f, fam in loads.items():
                fam.add_metric(labels, float(getattr(w.load, f)))
        queued = GaugeMetricFamily("pdserve_router_queued_requests",
                                   "requests queued past the decode workers' running ceilings")
        queued.add_metric([], float(sum(w.queued for w in entries if w.role in SERVING_ROLES)))
        yield up
        yield inflight
        yield queued
        yield from loads.values()


class RouterMetrics:
    """Request counters, TTFT / ITL / end-to-end / per-stage histograms, worker gauges."""

    def __init__(self, registry: Registry | None = None) -> None:
        self.prom = CollectorRegistry()
        self.requests = Counter("pdserve_router_requests", "HTTP/gRPC requests by outcome",
                                ["endpoint", "status"], registry=self.prom)
        self.finished = Counter("pdserve_router_finished", "finished generations by reason",
                                ["reason"], registry=self.prom)
        self.disagg = Counter("pdserve_router_disagg_decisions",
                              "requests by prefill placement (remote = disaggregated) and why",
                              ["decision", "reason"], registry=self.prom)
        self.retries = Counter("pdserve_router_retries", "attempts retried on a fresh pair",
                               registry=self.prom)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "prompt tokens",
                                     registry=self.prom)
        self.generation_tokens = Counter("pdserve_router_generation_tokens", "generated tokens",
                                         registry=self.prom)
        self.cached_tokens = Counter("pdserve_router_cached_tokens", "prompt tokens from cache",
                                     registry=self.prom)
        self.ttft = Histogram("pdserve_router_ttft_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.prom)
        self.itl = Histogram("pdserve_router_itl_seconds", "inter-token latency",
                             buckets=_ITL_BUCKETS, registry=self.prom)
        self.stage = Histogram("pdserve_router_stage_seconds", "per-stage time of requests",
                               ["stage"], buckets=_LATENCY_BUCKETS, registry=self.prom)
        self._registry = registry
        self.prom.register(_WorkerCollector(lambda: self._registry))

    def bind(self, registry: Registry) -> None:
        self._registry = registry

    def on_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_tokens(self, gap_s: float, num_tokens: int) -> None:
        per = gap_s / max(1, num_tokens)
        for _ in range(num_tokens):
            self.itl.observe(per)

    def on_disagg(self, decision: DisaggDecision) -> None:
        self.disagg.labels(decision="remote" if decision.disaggregated else "local",
                           reason=decision.reason).inc()

    def on_retry(self) -> None:
        self.retries.inc()

    def on_finish(self, reason: str, usage: Usage, timings: dict[str, float]) -> None:
        self.finished.labels(reason=reason).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        for name in TIMING_FIELDS:
            if timings.get(name):
                self.stage.labels(stage=name.removesuffix("_ms")).observe(timings[name] / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.prom)
