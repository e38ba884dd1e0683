"""RouterConfig: everything the router process needs, built once from flags and validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PREFILL_POLICIES = ("round_robin", "least_load", "cache_aware")
DECODE_POLICIES = ("round_robin", "least_load")


def _check_addr(name: str, addr: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}: worker address must be HOST:PORT, got {addr!r}")


@dataclass(frozen=True)
class RouterConfig:
    """Router settings. `http_port`/`grpc_port` 0 pick free ports (the bound ones are reported).

    Static worker addresses are queried with Worker.Status to learn their role; workers may also
    register themselves over the Router service (guarded by `registration_secret` when set; the
    same shared secret is sent to workers as `x-pdserve-secret` metadata on every Worker RPC).
    `api_key` guards the client APIs: HTTP /v1 and gRPC Generate/Abort/ListWorkers.
    """

    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    prefill_addrs: tuple[str, ...] = ()
    decode_addrs: tuple[str, ...] = ()
    mixed_addrs: tuple[str, ...] = ()
    model_path: str | None = None
    served_model_name: str | None = None  # name in /v1/models; defaults to the model's dir name
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    heartbeat_interval_s: float = 2.0
    lease_s: float = 10.0
    health_check_interval_s: float = 2.0
    health_check_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 * 1024 * 1024
    api_key: str | None = None
    registration_secret: str | None = None
    retries: int = 1
    # Requests queued past the decode workers' running ceilings before new ones get 429
    # (router/admission.py); None: 4 per running slot of the workers in rotation.
    max_queued_requests: int | None = None
    cache_aware_balance_abs: int = 8  # cache_aware: fall back to least load past this gap ...
    cache_aware_balance_rel: float = 1.5  # ... and when max load > rel * min load
    cache_aware_min_match: float = 0.5  # matched fraction of the prompt needed for affinity
    default_max_tokens: int = 256  # when the client gives none (bounded by the context left)
    disagg_threshold: int = 0  # uncached prompt tokens needed to prefill remotely (0 = always)
    local_prefill_fallback: bool = False  # no prefill worker: decode workers prefill locally
    slo_ttft_ms: float = 0.0  # > 0: place prefills by load too (router/slo_dispatch.py)
    slo_itl_ms: float = 0.0  # the decode side's inter-token SLO (its stall budget)
    tls_ca_file: str | None = None  # when set, worker channels use TLS trusting this CA
    tls_cert_file: str | None = None  # when set (with tls_key_file), the gRPC server uses TLS
    tls_key_file: str | None = None
    # Calls to a worker multiplexed on one Worker.Session stream (router/session.py) when it
    # serves one; False: one Prefill / Decode RPC per call.
    worker_session: bool = True
    k8s_discovery: Any = None  # a K8sDiscoveryConfig: workers from a pod label selector

    def __post_init__(self) -> None:
        for name in ("prefill_addrs", "decode_addrs", "mixed_addrs"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
            for addr in getattr(self, name):
                _check_addr(name, addr)
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError("host: must be a non-empty string")
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not isinstance(port, int) or not 0 <= port < 65536:
                raise ValueError(f"{name}: must be in [0, 65535] (0 = any free port), got {port!r}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(
                f"prefill_policy: must be one of {PREFILL_POLICIES}, got {self.prefill_policy!r}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(
                f"decode_policy: must be one of {DECODE_POLICIES}, got {self.decode_policy!r}")
        for name in ("heartbeat_interval_s", "lease_s", "health_check_interval_s",
                     "health_check_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {value!r}")
        if self.lease_s < self.heartbeat_interval_s:
            raise ValueError(
                f"lease_s: must be >= heartbeat_interval_s ({self.heartbeat_interval_s}), "
                f"got {self.lease_s}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes!r}")
        if not isinstance(self.retries, int) or not 0 <= self.retries <= 10:
            raise ValueError(f"retries: must be in [0, 10], got {self.retries!r}")
        if self.max_queued_requests is not None and (
                not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 0):
            raise ValueError(f"max_queued_requests: must be >= 0 (or unset: sized from the "
                             f"workers), got {self.max_queued_requests!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens < 1:
            raise ValueError(
                f"default_max_tokens: must be >= 1, got {self.default_max_tokens!r}")
        if self.cache_aware_balance_abs < 0 or self.cache_aware_balance_rel < 1.0:
            raise ValueError("cache_aware_balance_abs/rel: must be >= 0 and >= 1.0")
        if not 0.0 <= self.cache_aware_min_match <= 1.0:
            raise ValueError(
                f"cache_aware_min_match: must be in [0, 1], got {self.cache_aware_min_match}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must be non-empty when set")
        if self.registration_secret is not None and not self.registration_secret:
            raise ValueError("registration_secret: must be non-empty when set")
        if not isinstance(self.disagg_threshold, int) or self.disagg_threshold < 0:
            raise ValueError(
                "disagg_threshold: must be >= 0 tokens (0 = always), "
                f"got {self.disagg_threshold!r}")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name}: must be >= 0 ms (0 = off), got {value!r}")
        if self.slo_itl_ms > 0 and self.slo_ttft_ms <= 0:
            raise ValueError("slo_itl_ms: needs slo_ttft_ms (the SLO dispatcher) set as well")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file: give tls_cert_file and tls_key_file together")

    @property
    def model_name(self) -> str:
        """The name clients pass as `model` (also listed by /v1/models)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model_path:
            from pathlib import Path

            return Path(self.model_path.rstrip("/")).name or self.model_path
        return "default"
