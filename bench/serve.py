"""`pdserve bench`: a serving load generator against a running cluster.

    pdserve bench --base-url http://127.0.0.1:8000 --num-prompts 100 --request-rate 4 \\
        --input-len 64:256 --output-len 64 --output-dir out/

Sends streamed requests (HTTP SSE, or the router's gRPC Generate with `--grpc HOST:PORT`)
under Poisson / gamma arrivals or a concurrency cap, records every chunk's arrival time and
reports TTFT, ITL, TPOT, end-to-end latency, throughput, goodput and the router's per-stage
timings; with `--output-dir`, also serve_report.json and PNG plots. Definitions are in
serve_metrics. Exit status: 0 when every request succeeded, 1 when some failed, 2 on bad input
or an unreachable router. `--sweep-rate R1,R2,...` runs one Poisson load per rate instead and
reports goodput against rate (serve_sweep).
"""

from __future__ import annotations

import asyncio
import sys

import httpx

from pdserve.bench import serve_metrics, serve_report
from pdserve.bench.serve_client import GrpcBenchClient, HttpBenchClient
from pdserve.bench.serve_config import BenchConfig, config_from_args
from pdserve.bench.serve_runner import RunOutcome, resolve_model, run_bench
from pdserve.bench.serve_workload import build_workload


async def _run(cfg: BenchConfig) -> tuple[str, RunOutcome]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers) as http:
        model = await resolve_model(http, cfg.model)
        requests = build_workload(cfg, warmup=cfg.warmup)
        warmup, measured = requests[:cfg.warmup], requests[cfg.warmup:]
        client = GrpcBenchClient(cfg) if cfg.grpc_addr else HttpBenchClient(cfg, model)
        try:
            outcome = await run_bench(cfg, client, warmup, measured, http)
        finally:
            await client.close()
    return model, outcome


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config_from_args(argv)
    except ValueError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    if cfg.sweep_rates:
        from pdserve.bench.serve_sweep import main_sweep

        return main_sweep(cfg)
    try:
        model, outcome = asyncio.run(_run(cfg))
    except (ValueError, OSError, httpx.HTTPError) as e:
        print(f"pdserve bench: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    summary = serve_metrics.summarize(cfg, outcome)
    if cfg.output_dir:
        timeline = serve_metrics.timeline(outcome)
        path = serve_report.write_report(cfg.output_dir, cfg, model, summary, timeline,
                                         outcome.results)
        files = [path]
        try:
            from pdserve.bench.serve_plots import write_plots

            files += write_plots(cfg.output_dir, outcome.results, timeline, cfg.slo_ttft_ms,
                                 cfg.slo_itl_ms)
        except ImportError as e:
            print(f"pdserve bench: no plots ({e}); install matplotlib", file=sys.stderr)
        if not cfg.json:
            print("wrote " + ", ".join(files), file=sys.stderr)
    if cfg.json:
        print(serve_report.json_line(model, cfg, summary), flush=True)
    else:
        print(serve_report.format_table(cfg, summary), flush=True)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
