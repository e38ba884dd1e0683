"""Goodput of serving set-ups on one machine: a Poisson rate sweep per set-up, one table.

    python3 -P -m pdserve.bench.goodput_gpu --setups spatial:0.5,mixed:512,timesliced \\
        --out $OUT/goodput --budget-s 540

For each set-up (bench/goodput_setups.py) in turn: `pdserve up` (model, device from the
flags), `pdserve bench --sweep-rate ...` (2,048-token prompts -> 256 tokens by default, SLO
TTFT <= 1 s and TPOT <= 12 ms, `--duration` seconds of arrivals per rate, no higher rate once
attainment fell under half), then B requests at once, B the decode batch at the highest rate
that met the SLOs, for the decode step time at that batch (bench/decode_step.py), then stop.
Each section is on its own: a failure is reported and the next set-up still runs; one that
would not fit in what is left of `--budget-s` is skipped. Writes per set-up
`NAME/sweep_report.json` and logs, and `goodput.json` and `attainment.png` (every sweep on one
figure); prints the table last. Sweeps from several calls are compared with `python -m
pdserve.bench.serve_sweep_plot DIR1/NAME DIR2/NAME ... -o attainment.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field

from pdserve.bench.decode_step import steady_step_ms
from pdserve.bench.goodput_setups import Setup, parse_setup, start_cluster
from pdserve.bench.serve_goodput import points_from_json
from pdserve.worker.sm_share import daemon_pid, pipe_dir

MIN_SECTION_S = 100.0  # less left than this: the set-up is skipped
STOP_RESERVE_S = 40.0  # kept back from a sweep for the step run, stopping and the table


@dataclass
class Outcome:
    setup: Setup
    status: str = "not run"
    ready_s: float | None = None
    spatial: str = ""
    sweep: dict | None = None
    step_ms: float | None = None
    step_batch: int = 0
    notes: list[str] = field(default_factory=list)


def _bench_argv(args: argparse.Namespace, url: str) -> list[str]:
    return [sys.executable, "-m", "pdserve", "bench", "--base-url", url, "--no-progress",
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--slo-ttft", f"{args.slo_ttft:g}", "--slo-itl", f"{args.slo_itl:g}",
            "--request-timeout", "120", "--poll-interval", "0.25"]


def _run(argv: list[str], timeout_s: float, log_path: str, cwd: str) -> str:
    """Run a bench; its stdout (stderr to the log). RuntimeError on failure or timeout."""
    with open(log_path, "a", encoding="utf-8") as log:
        try:
            out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=log, text=True, cwd=cwd,
                                 timeout=max(1.0, timeout_s), check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s (log: {log_path})") from None
    if out.returncode not in (0, 1):  # 1: some requests failed, which is data
        raise RuntimeError(f"exit {out.returncode} (log: {log_path})")
    return out.stdout


def run_setup(args: argparse.Namespace, setup: Setup, deadline: float) -> Outcome:
    res = Outcome(setup)
    out_dir = os.path.join(args.out, setup.dir_name)
    os.makedirs(out_dir, exist_ok=True)
    up = [*shlex.split(args.model_args), "--device", args.device, "--port", "0",
          "--ready-timeout", f"{args.ready_timeout:g}",
          *setup.up_args(args.slo_ttft, args.slo_itl)]
    t0 = time.monotonic()
    cluster = start_cluster(up, os.path.join(out_dir, "up.log"))
    try:
        cluster.wait_ready(min(args.ready_timeout, deadline - time.monotonic()))
        res.ready_s = time.monotonic() - t0
        res.spatial = cluster.fields.get("spatial", "")
        if setup.kind != "spatial" and daemon_pid(pipe_dir()) is not None:
            res.notes.append(f"an MPS daemon serves {pipe_dir()}: its workers ran as MPS "
                             f"clients, not time-sliced")
        if setup.kind == "spatial" and res.spatial in ("", "off"):
            why = [x.strip() for x in cluster.lines if "--spatial:" in x]
            res.status = "no split: " + (why[-1] if why else "see up.log")
            return res
        rates = ",".join(f"{r:g}" for r in setup.rates)
        sweep_timeout = deadline - time.monotonic() - STOP_RESERVE_S
        stdout = _run([*_bench_argv(args, cluster.url), "--sweep-rate", rates,
                       "--sweep-duration", f"{args.duration:g}", "--sweep-stop-below", "0.5",
                       "--warmup", "4", "--label", setup.name, "--output-dir", out_dir,
                       "--json"], sweep_timeout, os.path.join(out_dir, "bench.log"), out_dir)
        res.sweep = json.loads(stdout.strip().splitlines()[-1])
        res.status = "ok"
        _measure_step(args, res, cluster.url, out_dir, deadline)
    except Exception as e:  # noqa: BLE001 - one set-up's failure must not end the run
        res.status = f"failed: {type(e).__name__}: {e}"[:300]
        with open(os.path.join(out_dir, "error.txt"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
    finally:
        rc = cluster.stop(timeout_s=30.0)
        if rc != 0:
            res.notes.append(f"pdserve up exited with {rc}")
    return res


def _measure_step(args: argparse.Namespace, res: Outcome, url: str, out_dir: str,
                  deadline: float) -> None:
    """The decode step at the batch of the highest rate that met the SLOs."""
    best = res.sweep.get("max_rate") if res.sweep else None
    point = next((p for p in points_from_json(res.sweep) if p.rate == best), None) \
        if best is not None else None
    left = deadline - time.monotonic() - 10.0
    if point is None or left < 15.0:
        res.notes.append("no step run" if point is not None else "no sustained rate")
        return
    batch = max(1, round(point.batch_mean))
    step_dir = os.path.join(out_dir, f"step-b{batch}")
    try:
        _run([*_bench_argv(args, url), "--num-prompts", str(batch), "--max-concurrency",
              str(batch), "--warmup", "0", "--seed", "7", "--output-dir", step_dir, "--json"],
             min(120.0, left), os.path.join(out_dir, "step.log"), out_dir)
        with open(os.path.join(step_dir, "bench_report.json"), encoding="utf-8") as f:
            res.step_ms, res.step_batch, _ = steady_step_ms(json.load(f))
    except (RuntimeError, OSError, ValueError) as e:
        res.notes.append(f"step run failed: {e}"[:200])


def outcome_json(res: Outcome) -> dict:
    s = res.setup
    return {"name": s.name, "kind": s.kind, "arg": s.arg, "slo_dispatch": s.slo_dispatch,
            "rates": list(s.rates), "status": res.status, "ready_s": res.ready_s,
            "spatial": res.spatial, "sweep": res.sweep, "step_ms": res.step_ms,
            "step_batch": res.step_batch, "notes": res.notes}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.goodput_gpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--setups", default="spatial,mixed:512,timesliced",
                   help="comma-separated KIND[:ARG][+slo][@R1/R2/...] (goodput_setups)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "goodput"),
                   help="default: $OUT/goodput")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall time for all set-ups; one that would not fit is skipped")
    p.add_argument("--model-args", default="--model-shape llama3-8b --load-format dummy",
                   help="how each worker gets its model (pdserve up flags)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ready-timeout", type=float, default=240.0)
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--slo-ttft", type=float, default=1000.0, help="ms")
    p.add_argument("--slo-itl", type=float, default=12.0, help="ms, on TPOT")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        setups = [parse_setup(s) for s in args.setups.split(",") if s.strip()]
    except ValueError as e:
        print(f"goodput_gpu: error: {e}", file=sys.stderr)
        return 2
    # `timeout` sends SIGTERM: unwind so the running cluster (its own process group) stops.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_all(args, setups)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_all(args: argparse.Namespace, setups: list[Setup]) -> int:
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    results: list[Outcome] = []
    for setup in setups:
        left = deadline - time.monotonic()
        if left < MIN_SECTION_S:
            results.append(Outcome(setup, status=f"skipped: {left:.0f} s left of the budget"))
            continue
        print(f"== {setup.name}: rates {'/'.join(f'{r:g}' for r in setup.rates)} "
              f"({left:.0f} s left)", flush=True)
        res = run_setup(args, setup, deadline)
        print(f"== {setup.name}: {res.status}", flush=True)
        results.append(res)
    from pdserve.bench.goodput_table import format_table

    rows = [outcome_json(r) for r in results]
    with open(os.path.join(args.out, "goodput.json"), "w", encoding="utf-8") as f:
        json.dump({"slo": {"ttft_ms": args.slo_ttft, "itl_ms": args.slo_itl},
                   "input_len": args.input_len, "output_len": args.output_len,
                   "duration_s": args.duration, "setups": rows}, f, indent=1)
    sweeps = [r["sweep"] for r in rows if r["sweep"]]
    if sweeps:
        try:
            from pdserve.bench.serve_sweep_plot import comparison_table, plot_attainment

            plot_attainment(os.path.join(args.out, "attainment.png"), sweeps)
            print(comparison_table(sweeps))
        except Exception as e:  # noqa: BLE001 - the table matters more than the figure
            print(f"goodput_gpu: no figure: {e}", file=sys.stderr)
    print(format_table(rows), flush=True)
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
