"""`pdserve bench` output: the summary table, the one-line JSON, bench_report.json."""

from __future__ import annotations

import dataclasses
import json
import math
import os

from pdserve.bench.serve_client import RequestResult
from pdserve.bench.serve_config import BenchConfig
from pdserve.bench.serve_metrics import itls_ms, output_tokens, tpot_ms, ttft_ms

REPORT_NAME = "bench_report.json"


def config_json(cfg: BenchConfig) -> dict:
    out = dataclasses.asdict(cfg)
    out.pop("api_key", None)
    if math.isinf(cfg.request_rate):
        out["request_rate"] = "inf"
    return out


def format_table(cfg: BenchConfig, s: dict) -> str:
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    rows: list[tuple[str, str]] = [
        ("Endpoint", f"{'gRPC ' + (cfg.grpc_addr or '') if cfg.grpc_addr else cfg.endpoint}"),
        ("Dataset", cfg.dataset),
        ("Request rate (req/s) / max concurrency",
         f"{rate} / {cfg.max_concurrency if cfg.max_concurrency else '-'}"),
        ("Successful / failed requests", f"{s['completed']} / {s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
        (f"Goodput (req/s, TTFT<={cfg.slo_ttft_ms:g} ms, TPOT<={cfg.slo_itl_ms:g} ms)",
         f"{s['goodput']:.2f} ({100 * s['slo_attainment']:.0f}% of requests)"),
    ]
    lines = ["=" * 22 + " Serving benchmark " + "=" * 22]
    lines += [f"{k:<48}{v:>15}" for k, v in rows]
    lines.append(f"{'latency (ms)':<16}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        st = s[name]
        lines.append(f"{name.removesuffix('_ms').upper():<16}" +
                     "".join(f"{st[k]:>12.2f}" for k in ("mean", "p50", "p90", "p99")))
    stages = s["stages"]
    lines.append(f"per-stage, router timings (source: {stages['source']})")
    for name, st in stages["stages_ms"].items():
        if name in stages["not_reported"]:
            lines.append(f"  {name:<14}{'(not reported)':>48}")
            continue
        cells = "".join(f"{st[k]:>12.2f}" if k in st else f"{'-':>12}"
                        for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"  {name:<14}{cells}")
    if stages["source"] == "metrics":
        lines.append(f"  {'':<14}(means of the /metrics stage histograms over the run)")
    if s["max_queue_depth"]:
        depth = ", ".join(f"{r} {n}" for r, n in sorted(s["max_queue_depth"].items()))
        lines.append(f"{'Max queue depth (waiting + running)':<40}{depth:>23}")
    for err, n in s["errors"].items():
        lines.append(f"error x{n}: {err}")
    lines.append("=" * 63)
    return "\n".join(lines)


def request_json(r: RequestResult) -> dict:
    ok = r.ok
    return {"start_s": round(r.start_s, 6), "ok": ok, "error": r.error,
            "input_len": r.input_len, "prompt_tokens": r.prompt_tokens,
            "output_len": r.output_len, "output_tokens": output_tokens(r) if ok else 0,
            "cached_tokens": r.cached_tokens,
            "ttft_ms": ttft_ms(r) if ok else None, "tpot_ms": tpot_ms(r) if ok else None,
            "e2e_ms": r.end_s * 1e3, "itl_ms": [round(g, 3) for g in itls_ms(r)] if ok else [],
            "timings": r.timings, "prefill_worker": r.prefill_worker,
            "decode_worker": r.decode_worker}


def write_report(out_dir: str, cfg: BenchConfig, model: str, summary: dict, timeline: dict,
                 results: list[RequestResult]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, REPORT_NAME)
    report = {"model": model, "config": config_json(cfg), "summary": summary,
              "timeline": timeline, "requests": [request_json(r) for r in results]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return path


def json_line(model: str, cfg: BenchConfig, summary: dict) -> str:
    return json.dumps({"model": model, "config": config_json(cfg), **summary})
