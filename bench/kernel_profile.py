"""Side by side, the kernels of each process's long extends (`PDSERVE_KERNEL_PROFILE` files).

    python -m pdserve.bench.kernel_profile DIR [--skip N] [--top K]

Per file (one process: the offline engine or one worker; its warm-up's steps are the first
ones, `--skip` drops them): the median step's wall time, summed kernel time and the kernels'
span (longer than their sum: the device waited between them), then the K kernels
with the most time, median milliseconds per step in each process. The same kernels slower in
one process point at the device (clocks, a neighbour's work); different kernels at the code.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

from pdserve.bench.step_trace import who


def read(path: str) -> tuple[dict, list[dict]]:
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return lines[0], lines[1:]


def summary(steps: list[dict]) -> dict:
    names = {k for s in steps for k in s["kernels"]}
    return {"steps": len(steps),
            "tokens": statistics.median(s["tokens"] for s in steps),
            "wall_ms": statistics.median(s["wall_ms"] for s in steps),
            "kernel_ms": statistics.median(s["kernel_ms"] for s in steps),
            "span_ms": statistics.median(s.get("span_ms", 0.0) for s in steps),
            "kernels": {k: statistics.median(s["kernels"].get(k, 0.0) for s in steps)
                        for k in names}}


def table(procs: list[tuple[str, dict]], top: int) -> str:
    lines = ["process  steps  tokens  wall ms  kernels ms  span ms"]
    lines += [f"{name}  {s['steps']}  {s['tokens']:.0f}  {s['wall_ms']:.3f}  {s['kernel_ms']:.3f}"
              f"  {s['span_ms']:.3f}" for name, s in procs]
    total: dict[str, float] = {}
    for _, s in procs:
        for k, v in s["kernels"].items():
            total[k] = max(total.get(k, 0.0), v)
    lines.append("")
    lines.append("  ".join(name for name, _ in procs) + "  kernel (median ms per step)")
    for k in sorted(total, key=total.get, reverse=True)[:top]:
        cells = "  ".join(f"{s['kernels'].get(k, 0.0):.3f}" for _, s in procs)
        lines.append(f"{cells}  {k[:90]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.kernel_profile",
                                description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--skip", type=int, default=2, help="first steps of each file to drop")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    procs = []
    for path in sorted(glob.glob(os.path.join(args.folder, "kernels-*.jsonl"))):
        head, steps = read(path)
        if steps[args.skip:]:
            procs.append((who(head), summary(steps[args.skip:])))
    if not procs:
        print(f"kernel_profile: no profiled steps in {args.folder}", file=sys.stderr)
        return 1
    print(table(procs, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
