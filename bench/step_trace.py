"""Summaries of `PDSERVE_STEP_TRACE` files per time window: the offline engine's steps beside a
served worker's on the same workload.

    python -m pdserve.bench.step_trace DIR [--window NAME:START:END ...]
    python -m pdserve.bench.step_trace SERVE_BENCH_OUT      (windows from serve_bench.json)

Per window and trace file (one process: the offline engine or one worker): extend steps (count,
mean tokens, seconds), decode steps (count, mean batch, p50 / mean ms), the share of the time
from its first step to the end of its last that the scheduler spent inside steps, and the
seconds between steps (no work, or its inbox and the transfer queues).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    name: str
    start: float  # wall clock, s
    end: float


def read_trace(path: str) -> tuple[dict, list[dict]]:
    """(header, step rows) of one file."""
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    head = lines[0] if lines and "argv" in lines[0] else {}
    return head, [r for r in lines if "dt" in r]


def who(head: dict) -> str:
    """A short name for the process that wrote a trace: its pdserve role, or the module."""
    argv = [str(a) for a in head.get("argv", [])]
    for role in ("prefill", "decode", "mixed"):
        if role in argv:
            return f"{role}[{head.get('pid')}]"
    name = os.path.basename(argv[0]) if argv else "?"
    return f"{name.removesuffix('.py')}[{head.get('pid')}]"


def summarize(rows: list[dict], window: Window) -> dict | None:
    """The window's steps (those that started in it), or None if it has none."""
    steps = [r for r in rows if window.start <= r["t"] < window.end]
    if not steps:
        return None
    # From the first step to the end of the last: a window's edges (a load generator starting,
    # the run's tail) are not the scheduler's gaps.
    span = max(max(r["t"] + r["dt"] for r in steps) - steps[0]["t"], 1e-9)
    ext = [r for r in steps if r["mode"] == "extend"]
    dec = [r for r in steps if r["mode"] == "decode"]
    busy = sum(r["dt"] for r in steps)
    dec_ms = [r["dt"] * 1e3 for r in dec]
    return {"steps": len(steps), "extend_steps": len(ext),
            "extend_tokens_mean": statistics.mean(r["n"] for r in ext) if ext else 0.0,
            "extend_s": sum(r["dt"] for r in ext), "decode_steps": len(dec),
            "decode_batch_mean": statistics.mean(r["n"] for r in dec) if dec else 0.0,
            "decode_ms_p50": statistics.median(dec_ms) if dec else 0.0,
            "decode_ms_mean": statistics.mean(dec_ms) if dec else 0.0,
            "busy_share": busy / span, "between_steps_s": span - busy, "window_s": span}


def windows_of_report(report: dict) -> list[tuple[str, Window]]:
    """(phase, window) pairs that serve-bench recorded: offline and served, per workload."""
    out = []
    phases = {"offline": report.get("offline", {}).get("workloads", {}),
              **report.get("served", {})}
    for phase, loads in phases.items():
        for name, res in loads.items():
            if isinstance(res, dict) and "t_start" in res:
                out.append((phase, Window(name, res["t_start"], res["t_end"])))
    return out


def table(rows: list[tuple[str, str, dict]]) -> str:
    cols = [("window", None), ("process", None), ("extend", "extend_steps"),
            ("tok/ext", "extend_tokens_mean"), ("ext s", "extend_s"),
            ("decode", "decode_steps"), ("batch", "decode_batch_mean"),
            ("dec p50 ms", "decode_ms_p50"), ("dec mean ms", "decode_ms_mean"),
            ("in steps", "busy_share"), ("between s", "between_steps_s"), ("window s", "window_s")]
    out = [[c for c, _ in cols]]
    for window, proc, s in rows:
        out.append([window, proc] + [f"{s[k]:.3f}" if isinstance(s[k], float) else str(s[k])
                                     for _, k in cols[2:]])
    widths = [max(len(r[i]) for r in out) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in out)


def report_rows(folder: str, windows: list[tuple[str, Window]]) -> list[tuple[str, str, dict]]:
    traces = [read_trace(p) for p in sorted(glob.glob(os.path.join(folder, "steps-*.jsonl")))]
    out = []
    for phase, w in windows:
        for head, rows in traces:
            s = summarize(rows, w)
            if s is not None:
                out.append((f"{phase}:{w.name}", who(head), s))
    return out


def _window(spec: str) -> tuple[str, Window]:
    name, start, end = spec.rsplit(":", 2)
    return "", Window(name, float(start), float(end))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.step_trace",
                                description=__doc__.splitlines()[0])
    p.add_argument("folder", help="the traces' folder, or serve-bench's --out (its steps/)")
    p.add_argument("--window", action="append", default=[], type=_window,
                   help="NAME:START:END in wall-clock seconds (default: the whole of each file)")
    args = p.parse_args(argv)
    folder, windows = args.folder, list(args.window)
    report = os.path.join(folder, "serve_bench.json")
    if os.path.exists(report):
        with open(report, encoding="utf-8") as f:
            windows = windows or windows_of_report(json.load(f))
        folder = os.path.join(folder, "steps")
    if not windows:
        windows = [("", Window("all", 0.0, float("inf")))]
    rows = report_rows(folder, windows)
    if not rows:
        print(f"step_trace: no steps in {folder} for those windows", file=sys.stderr)
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
