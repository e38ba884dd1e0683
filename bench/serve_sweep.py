"""`pdserve bench --sweep-rate R1,R2,...`: one Poisson run per rate against one cluster.

    pdserve bench --sweep-rate 1,2,4,8 --sweep-duration 20 --input-len 2048 --output-len 256 \\
        --slo-ttft 1000 --slo-itl 12 --label spatial --output-dir out/

Each rate sends its own requests (the workload's seed moves with the rate, so no rate finds the
previous one's prompts in the prefix cache) and runs until all of them ended; the warm-up goes
once, before the first rate. Prints one row per rate (goodput, SLO attainment, TTFT/TPOT/ITL)
and the highest rate at which `--slo-attainment` of the requests met both SLOs (serve_goodput).
With `--output-dir`: sweep_report.json (every rate's summary and per-request TTFT/TPOT, enough
to recompute attainment for other SLOs) and attainment.png; `python -m
pdserve.bench.serve_sweep_plot` draws several such reports on one figure.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass, replace

import httpx

from pdserve.bench import serve_metrics
from pdserve.bench.serve_client import GrpcBenchClient, HttpBenchClient
from pdserve.bench.serve_config import BenchConfig
from pdserve.bench.serve_goodput import (
    SweepPoint,
    format_sweep_table,
    requests_at,
    sweep_summary,
)
from pdserve.bench.serve_report import config_json
from pdserve.bench.serve_runner import RunOutcome, resolve_model, run_bench
from pdserve.bench.serve_workload import build_workload

REPORT_NAME = "sweep_report.json"
SEED_STRIDE = 1000  # rate i uses seed + i * SEED_STRIDE (its arrivals seed + 1 more)


@dataclass
class RateRun:
    cfg: BenchConfig  # the per-rate config: request_rate, num_prompts, seed
    outcome: RunOutcome
    summary: dict


def rate_config(cfg: BenchConfig, index: int, rate: float) -> BenchConfig:
    return replace(cfg, request_rate=rate, seed=cfg.seed + index * SEED_STRIDE,
                   num_prompts=requests_at(rate, cfg.num_prompts, cfg.sweep_duration_s),
                   max_concurrency=cfg.max_concurrency, sweep_rates=())


async def run_sweep(cfg: BenchConfig) -> tuple[str, list[RateRun]]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    runs: list[RateRun] = []
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers) as http:
        model = await resolve_model(http, cfg.model)
        client = GrpcBenchClient(cfg) if cfg.grpc_addr else HttpBenchClient(cfg, model)
        try:
            for i, rate in enumerate(cfg.sweep_rates):
                rcfg = rate_config(cfg, i, rate)
                warm = cfg.warmup if i == 0 else 0
                requests = build_workload(rcfg, warmup=warm)
                outcome = await run_bench(rcfg, client, requests[:warm], requests[warm:], http)
                summary = serve_metrics.summarize(rcfg, outcome)
                runs.append(RateRun(rcfg, outcome, summary))
                print(f"rate {rate:g} req/s: {summary['completed']}/{rcfg.num_prompts} ok, "
                      f"goodput {summary['goodput']:.2f} req/s, attainment "
                      f"{100 * summary['slo_attainment']:.0f}%", file=sys.stderr, flush=True)
                if summary["slo_attainment"] < cfg.sweep_stop_below:
                    left = [f"{r:g}" for r in cfg.sweep_rates[i + 1:]]
                    if left:
                        print(f"attainment below {cfg.sweep_stop_below:g}: rates "
                              f"{','.join(left)} not run", file=sys.stderr, flush=True)
                    break
        finally:
            await client.close()
    return model, runs


def request_rows(outcome: RunOutcome) -> list[dict]:
    """Per request: enough to recompute SLO attainment later (not every ITL)."""
    rows = []
    for r in outcome.results:
        ok = r.ok
        rows.append({"start_s": round(r.start_s, 4), "ok": ok,
                     "ttft_ms": round(serve_metrics.ttft_ms(r), 3) if ok else None,
                     "tpot_ms": serve_metrics.tpot_ms(r) if ok else None,
                     "output_tokens": serve_metrics.output_tokens(r) if ok else 0})
    return rows


def write_sweep_report(out_dir: str, cfg: BenchConfig, model: str, summary: dict,
                       runs: list[RateRun]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, REPORT_NAME)
    report = {"model": model, "config": config_json(cfg), "sweep": summary,
              "rates": [{"rate": run.cfg.request_rate, "summary": run.summary,
                         "requests": request_rows(run.outcome)} for run in runs]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return path


def main_sweep(cfg: BenchConfig) -> int:
    try:
        model, runs = asyncio.run(run_sweep(cfg))
    except (ValueError, OSError, httpx.HTTPError) as e:
        print(f"pdserve bench: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    points = [SweepPoint.from_summary(run.cfg.request_rate, run.summary) for run in runs]
    summary = sweep_summary(points, cfg.slo_target, cfg.slo_ttft_ms, cfg.slo_itl_ms, cfg.label)
    if cfg.output_dir:
        files = [write_sweep_report(cfg.output_dir, cfg, model, summary, runs)]
        try:
            from pdserve.bench.serve_sweep_plot import plot_attainment

            files.append(plot_attainment(os.path.join(cfg.output_dir, "attainment.png"),
                                         [summary]))
        except ImportError as e:
            print(f"pdserve bench: no plot ({e}); install matplotlib", file=sys.stderr)
        if not cfg.json:
            print("wrote " + ", ".join(files), file=sys.stderr)
    if cfg.json:
        print(json.dumps({"model": model, **summary}), flush=True)
    else:
        print(format_sweep_table(summary), flush=True)
    return 0 if all(p.failed == 0 for p in points) else 1
