"""`pdserve bench` configuration: one frozen dataclass built once from the command line."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from pdserve.bench.serve_goodput import check_rates, parse_rates

DATASETS = ("random", "shared-prefix", "multi-turn", "sharegpt")
ENDPOINTS = ("completions", "chat")


def parse_range(text: str, name: str) -> tuple[int, int]:
    """`N` -> (N, N); `LO:HI` -> (LO, HI), both inclusive."""
    lo_s, sep, hi_s = text.partition(":")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    except ValueError:
        raise ValueError(f"{name}: expected N or LO:HI, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{name}: need 1 <= LO <= HI, got {text!r}")
    return lo, hi


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    grpc_addr: str | None = None  # set: requests go through Router.Generate instead of HTTP
    endpoint: str = "completions"
    model: str | None = None  # None: the first id of /v1/models
    api_key: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    tokenizer: str | None = None
    num_prompts: int = 100
    input_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (64, 64)
    prefix_len: int = 256  # shared-prefix / multi-turn: tokens of each system prompt
    num_prefixes: int = 4  # shared-prefix: distinct system prompts
    num_turns: int = 3  # multi-turn: user turns per conversation
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    max_concurrency: int | None = None
    warmup: int = 2
    temperature: float = 0.0
    seed: int = 0
    slo_ttft_ms: float = 1000.0
    slo_itl_ms: float = 100.0
    sweep_rates: tuple[float, ...] = ()  # set: one run per Poisson rate (serve_sweep)
    sweep_duration_s: float = 0.0  # > 0: about this many seconds of arrivals per rate
    slo_target: float = 0.9  # attainment a rate must reach to count as sustained
    sweep_stop_below: float = 0.0  # sweep: no higher rate once attainment fell below this
    label: str = ""  # the run's name in sweep reports and plots
    request_timeout_s: float = 600.0
    poll_interval_s: float = 0.5
    output_dir: str | None = None
    json: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset: expected one of {DATASETS}, got {self.dataset!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: expected one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset_path: --dataset sharegpt needs --dataset-path FILE")
        if self.grpc_addr and (self.endpoint == "chat" or self.dataset == "multi-turn"):
            raise ValueError("grpc_addr: Router.Generate takes raw text; use --endpoint "
                             "completions and a single-turn dataset")
        for name in ("num_prompts", "prefix_len", "num_prefixes", "num_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup: must be >= 0, got {self.warmup}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        for name in ("slo_ttft_ms", "slo_itl_ms", "request_timeout_s", "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.sweep_rates:
            check_rates(tuple(self.sweep_rates))
        if not (math.isfinite(self.sweep_duration_s) and self.sweep_duration_s >= 0):
            raise ValueError(f"sweep_duration_s: must be >= 0, got {self.sweep_duration_s}")
        if not 0 < self.slo_target <= 1:
            raise ValueError(f"slo_target: must be in (0, 1], got {self.slo_target}")
        if not 0 <= self.sweep_stop_below <= 1:
            raise ValueError(f"sweep_stop_below: must be in [0, 1], got {self.sweep_stop_below}")

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench",
                                description="Serving load generator: TTFT, ITL, goodput.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="router HTTP address (also polled for /workers and /metrics)")
    p.add_argument("--grpc", dest="grpc_addr", default=None, metavar="HOST:PORT",
                   help="send requests through the router's gRPC Generate instead of HTTP")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    p.add_argument("--model", default=None, help="default: the first id from /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer path: exact input lengths (else ~1 token per word)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", default="128", help="tokens: N or LO:HI (uniform)")
    p.add_argument("--output-len", default="64", help="tokens: N or LO:HI (uniform)")
    p.add_argument("--prefix-len", type=int, default=256, help="shared system prompt tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct system prompts")
    p.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per conversation")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times; 1 = Poisson, < 1 = burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2, help="requests sent first, not measured")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=1000.0, help="ms, for goodput")
    p.add_argument("--slo-itl", type=float, default=100.0,
                   help="ms, for goodput: bound on a request's mean inter-token latency (TPOT)")
    p.add_argument("--sweep-rate", default=None, metavar="R1,R2,...",
                   help="one Poisson run per rate (req/s): goodput per rate and the highest "
                        "rate meeting both SLOs for --slo-attainment of the requests")
    p.add_argument("--sweep-duration", type=float, default=0.0, metavar="S",
                   help="sweep: about S seconds of arrivals per rate (0: --num-prompts each)")
    p.add_argument("--slo-attainment", type=float, default=0.9,
                   help="sweep: share of requests that must meet both SLOs")
    p.add_argument("--sweep-stop-below", type=float, default=0.0, metavar="A",
                   help="sweep: skip the higher rates once attainment fell below A (0 = never)")
    p.add_argument("--label", default="", help="sweep: this run's name in reports and plots")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /workers")
    p.add_argument("--output-dir", default=None, help="write bench_report.json and PNG plots")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(argv: list[str] | None) -> BenchConfig:
    a = build_parser().parse_args(argv)
    return BenchConfig(
        base_url=a.base_url.rstrip("/"), grpc_addr=a.grpc_addr, endpoint=a.endpoint,
        model=a.model, api_key=a.api_key, dataset=a.dataset, dataset_path=a.dataset_path,
        tokenizer=a.tokenizer, num_prompts=a.num_prompts,
        input_len=parse_range(a.input_len, "input_len"),
        output_len=parse_range(a.output_len, "output_len"), prefix_len=a.prefix_len,
        num_prefixes=a.num_prefixes, num_turns=a.num_turns, request_rate=a.request_rate,
        burstiness=a.burstiness, max_concurrency=a.max_concurrency, warmup=a.warmup,
        temperature=a.temperature, seed=a.seed, slo_ttft_ms=a.slo_ttft, slo_itl_ms=a.slo_itl,
        sweep_rates=parse_rates(a.sweep_rate) if a.sweep_rate is not None else (),
        sweep_duration_s=a.sweep_duration, slo_target=a.slo_attainment,
        sweep_stop_below=a.sweep_stop_below, label=a.label,
        request_timeout_s=a.request_timeout, poll_interval_s=a.poll_interval,
        output_dir=a.output_dir, json=a.json, progress=not a.no_progress)
