"""`scripts/serve-bench`: the offline engine against the served path on the same workloads, in
one run, and a table of ratios last.

    python -m pdserve.bench.serve_compare [--device cuda] [--quick] [--out DIR]

Workloads (GPU sizes; `--quick` shrinks them for a CPU smoke run): (a) one client, 2,048-token
prompts -> 32 tokens; (b) 64 clients, 512 -> 256; (c) 256 clients, 512 -> 256, each client in
a closed loop. Steps: the offline engine in a process of its own (serve_offline.py); then a
cluster of one `mixed` worker and one of a prefill and a decode worker (`pdserve up` with the
same model shape, request slots and KV pages), each driven by `pdserve bench` through HTTP on
every workload, and once (workload b, mixed) by an independent client (serve_check.py). Every
prompt is the same token ids on every side (pdserve bench's generator, exact lengths from the
embedded tokenizer). Logs and serve_bench.json go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from pdserve.bench.goodput_setups import spatial_flags
from pdserve.engine.model_shapes import shape_names


@dataclass(frozen=True)
class Workload:
    name: str
    clients: int
    input_len: int
    output_len: int
    num_prompts: int


GPU_WORKLOADS = (Workload("a", 1, 2048, 32, 8), Workload("b", 64, 512, 256, 192),
                 Workload("c", 256, 512, 256, 384))
QUICK_WORKLOADS = (Workload("a", 1, 128, 8, 2), Workload("b", 4, 32, 16, 8),
                   Workload("c", 8, 32, 16, 16))
BENCH_WARMUP = 2  # pdserve bench's warm-up requests (they come first from its generator)
# served tok/s over offline's
TARGETS = {"mixed": 0.95, "pd": 0.90, "pd-timesliced": 0.90, "pd-spatial": 0.90}
LABELS = {"mixed": "mixed", "pd": "1P1D", "pd-timesliced": "1P1D time-sliced",
          "pd-spatial": "1P1D spatial"}


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """What the offline and the served side must agree on."""
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--model-shape", default=None, choices=shape_names(),
                   help="default: llama3-8b on CUDA, tiny with --quick")
    p.add_argument("--quick", action="store_true", help="small workloads (a CPU smoke run)")
    p.add_argument("--workloads", default=None,
                   help="instead of the built-in sizes: NAME:CLIENTS:IN:OUT:PROMPTS,... "
                        "(one client: TTFT and ITL; more: output tok/s)")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pages per worker (default: enough for workload c)")
    p.add_argument("--seed", type=int, default=0)


def workloads_of(args: argparse.Namespace) -> tuple[Workload, ...]:
    if args.model_shape is None:
        args.model_shape = "tiny" if args.quick else "llama3-8b"
    loads = QUICK_WORKLOADS if args.quick else GPU_WORKLOADS
    if args.workloads:
        loads = parse_workloads(args.workloads)
    if args.num_pages is None:  # every client of the largest load at full length, and 25%
        need = max(w.clients * -(-(w.input_len + w.output_len) // 16) for w in loads)
        args.num_pages = need * 5 // 4 + 64
    return loads


def parse_workloads(spec: str) -> tuple[Workload, ...]:
    """`NAME:CLIENTS:IN:OUT:PROMPTS,...` -> workloads (ValueError naming the bad one)."""
    out = []
    for item in (x for x in spec.split(",") if x):
        parts = item.split(":")
        try:
            if len(parts) != 5:
                raise ValueError
            name, nums = parts[0], [int(x) for x in parts[1:]]
            if not name or min(nums) < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"--workloads: {item!r} is not NAME:CLIENTS:IN:OUT:PROMPTS with "
                             "positive numbers") from None
        out.append(Workload(name, *nums))
    if not out:
        raise ValueError("--workloads: no workload given")
    return tuple(out)


def workload_seed(seed: int, index: int) -> int:
    """The prompt seed of the index-th workload: each its own prompts (no workload's prompts
    hit another's in the radix cache, offline or served), `+ 1` left for a second set."""
    return seed + 10 * index


def bench_args(w: Workload, seed: int, tokenizer: str) -> list[str]:
    """`pdserve bench` flags of workload `w` (prompts as exact token ids)."""
    return ["--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.clients),
            "--input-len", str(w.input_len), "--output-len", str(w.output_len),
            "--seed", str(seed), "--tokenizer", tokenizer, "--warmup", str(BENCH_WARMUP),
            "--temperature", "0"]


def prompts(w: Workload, seed: int) -> list[list[int]]:
    """The token ids `pdserve bench` sends for `w` (after its warm-up requests)."""
    from pdserve.bench.serve_config import config_from_args
    from pdserve.bench.serve_workload import build_workload
    from pdserve.engine.default_model import default_tokenizer_path

    cfg = config_from_args(bench_args(w, seed, default_tokenizer_path()))
    return [r.prompt for r in build_workload(cfg, warmup=cfg.warmup)[cfg.warmup:]]


def _topologies(served: dict) -> list[str]:
    """The columns: mixed and 1P1D always (a dash where not run), the others when run."""
    return [t for t in TARGETS if t in ("mixed", "pd") or t in served]


def _row(name: str, metric: str, offline: float | None, served: dict[str, float | None],
         unit: str, target: str, topos: list[str]) -> list[str]:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    def ratio(v: float | None) -> str:
        return "-" if v is None or not offline else f"{v / offline:.3f}"

    cells = [c for t in topos for c in (fmt(served.get(t)), ratio(served.get(t)))]
    return [name, metric, fmt(offline), *cells, unit, target]


def table(report: dict) -> str:
    """The ratios: served over offline (throughput), TTFT and ITL against their targets."""
    off, served = report["offline"], report["served"]
    topos = _topologies(served)
    rows = [["workload", "metric", "offline",
             *(c for t in topos for c in (LABELS[t], "ratio")), "unit", "target"]]
    a = off["workloads"].get("a", {})
    get = {topo: served.get(topo, {}).get("a", {}) for topo in topos}
    rows.append(_row("(a) 1 client", "TTFT p50", a.get("ttft_ms"),
                     {t: g.get("ttft_p50_ms") for t, g in get.items()}, "ms",
                     "<= 1.05x offline + 2 ms", topos))
    rows.append(_row("(a) 1 client", "ITL p50 vs roofline", off.get("roofline_ms"),
                     {t: g.get("itl_p50_ms") for t, g in get.items()}, "ms",
                     "<= 1.12x roofline", topos))
    rows.append(["(a) 1 client", "ITL offline", f"{a.get('itl_ms', 0):,.2f}",
                 *[""] * (2 * len(topos)), "ms", ""])
    for w in report["workloads"]:
        if w["clients"] == 1:
            continue
        tok = {t: served.get(t, {}).get(w["name"], {}).get("output_tok_s") for t in topos}
        rows.append(_row(f"({w['name']}) {w['clients']} clients", "output tok/s",
                         off["workloads"].get(w["name"], {}).get("output_tok_s"), tok, "tok/s",
                         ">= 0.95 mixed, >= 0.90 1P1D", topos))
    check = report.get("check")
    if check:
        rows.append(["(b) check", f"{check['client']} tok/s vs pdserve bench",
                     f"{check['bench_tok_s']:,.1f}", f"{check['output_tok_s']:,.1f}",
                     f"{check['output_tok_s'] / max(check['bench_tok_s'], 1e-9):.3f}",
                     *[""] * (2 * len(topos) - 2), "tok/s", "~1.0"])
    # The SM split each 1P1D cluster ran with (under its column): `off` where time-sliced.
    splits = {t: served[t].get("spatial") for t in topos if t != "mixed" and t in served}
    if any(splits.values()) or "pd-spatial" in splits:
        cells = [""] * (2 * len(topos))
        for t, split in splits.items():
            cells[2 * topos.index(t)] = split or ("?" if t == "pd-spatial" else "off")
        rows.append(["1P1D", "SM split (prefill/decode %)", "", *cells, "", ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(r, widths)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    from pdserve.bench.serve_cluster import run_offline, run_served

    p = argparse.ArgumentParser(prog="scripts/serve-bench", description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--out", default=os.environ.get("OUT") or "serve-bench-out")
    p.add_argument("--topologies", default="mixed,pd",
                   help="served clusters to run, of " + ", ".join(TARGETS)
                        + " (pd: as pdserve up runs it; pd-timesliced: --no-spatial; "
                          "pd-spatial: --spatial with --sm-split)")
    p.add_argument("--sm-split", default="", metavar="P/D",
                   help="pd-spatial: the prefill and decode workers' shares of the SMs (e.g. "
                        "0.5/1.0: prefill capped at half, decode uncapped; default: pdserve "
                        "up's)")
    p.add_argument("--no-check", action="store_true", help="skip the independent client")
    p.add_argument("--step-trace", action="store_true",
                   help="every scheduler writes its steps to OUT/steps (PDSERVE_STEP_TRACE); "
                        "a table of them per workload comes before the ratios")
    p.add_argument("--py-spy", action="store_true",
                   help="py-spy on the router and every worker during each served workload "
                        "(OUT/pyspy; a summary per process comes before the ratios)")
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                   help="an extra router flag for every served cluster (e.g. "
                        "--router-arg=--no-worker-session)")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="start no phase past this many seconds (the table still comes)")
    args = p.parse_args(argv)
    unknown = [t for t in args.topologies.split(",") if t and t not in TARGETS]
    if unknown:
        p.error(f"--topologies: unknown {', '.join(unknown)} (choose from {', '.join(TARGETS)})")
    try:
        args.spatial_flags = spatial_flags(args.sm_split)
    except ValueError as e:
        p.error(f"--sm-split: {e}")
    loads = workloads_of(args)
    os.makedirs(args.out, exist_ok=True)
    steps_dir = os.path.join(os.path.abspath(args.out), "steps")
    if args.step_trace:  # inherited by the offline process, `pdserve up` and its workers
        os.environ.update(PDSERVE_STEP_TRACE=steps_dir)
    t0 = time.perf_counter()
    args.deadline = t0 + args.budget_s
    report: dict = {"args": {k: v for k, v in vars(args).items() if k != "deadline"},
                    "workloads": [asdict(w) for w in loads], "served": {}, "phases_s": {},
                    "errors": {}}
    phases = [("offline", lambda: run_offline(args, report))]
    phases += [(topo, lambda topo=topo: run_served(args, loads, topo, report))
               for topo in args.topologies.split(",") if topo]
    for name, run in phases:
        if time.perf_counter() > args.deadline:
            report["errors"][name] = "skipped: out of the time budget"
            continue
        try:
            result = run()
        except (RuntimeError, OSError, ValueError, KeyError,
                subprocess.TimeoutExpired) as e:  # the other phases still run
            report["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"serve-bench: {name} failed: {e}", file=sys.stderr, flush=True)
            continue
        if name == "offline":
            report["offline"] = result
        else:
            report["served"][name] = result
    report.setdefault("offline", {"workloads": {}})
    report["phases_s"]["total"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "serve_bench.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    if args.step_trace:
        from pdserve.bench.step_trace import report_rows, windows_of_report
        from pdserve.bench.step_trace import table as steps_table

        rows = report_rows(steps_dir, windows_of_report(report))
        print("== scheduler steps per workload (bench/step_trace.py)")
        print(steps_table(rows) if rows else "(no steps recorded)", flush=True)
    from pdserve.bench.serve_profile import table as spy_table

    for name, procs in report.get("py_spy", {}).items():
        print(f"== py-spy, {name} (bench/serve_profile.py)")
        print("\n".join(spy_table(role, s) for role, s in procs.items()), flush=True)
    print(f"== serve-bench: {args.model_shape} on {report['offline'].get('gpu') or args.device}"
          f", {report['phases_s']['total']:.0f} s; logs and serve_bench.json in {args.out}")
    print(table(report), flush=True)
    for name, why in report["errors"].items():
        print(f"{name}: {why}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
