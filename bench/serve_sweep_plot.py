"""SLO attainment and goodput against request rate, several sweeps on one figure.

    python -m pdserve.bench.serve_sweep_plot -o attainment.png \\
        spatial/sweep_report.json mixed-512/sweep_report.json=mixed-512 ...

Each argument is a sweep_report.json (or the directory holding one, or the one-line JSON of
`pdserve bench --sweep-rate ... --json`), optionally `=LABEL` to rename it. Prints a table of
each sweep's highest sustained rate and its ratio to the `--baseline` sweep (default: the best
sweep whose label starts with `mixed`, else the first), then writes the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pdserve.bench.serve_goodput import points_from_json

DPI = 80


def load_summary(arg: str) -> dict:
    """`PATH[=LABEL]` -> a sweep summary (see serve_goodput.sweep_summary)."""
    path, _, label = arg.partition("=")
    if os.path.isdir(path):
        path = os.path.join(path, "sweep_report.json")
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        data = json.loads(text)
    except ValueError:  # a captured stdout: the JSON line is the last one
        data = json.loads(text.splitlines()[-1])
    summary = data.get("sweep", data)
    if "points" not in summary:
        raise ValueError(f"{path}: not a sweep report (no 'points')")
    if label:
        summary = {**summary, "label": label}
    elif not summary.get("label"):
        summary = {**summary, "label": os.path.basename(os.path.dirname(path)) or path}
    return summary


def plot_attainment(path: str, summaries: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3), dpi=DPI)
    target = summaries[0]["target"] if summaries else 0.9
    for s in summaries:
        pts = sorted(points_from_json(s), key=lambda p: p.rate)
        rates = [p.rate for p in pts]
        line = a.plot(rates, [100 * p.attainment for p in pts], marker="o", markersize=3,
                      label=s["label"])[0]
        b.plot(rates, [p.goodput for p in pts], marker="o", markersize=3, label=s["label"],
               color=line.get_color())
        if s.get("max_rate_interpolated"):
            a.axvline(s["max_rate_interpolated"], color=line.get_color(), linestyle=":",
                      linewidth=1)
    a.axhline(100 * target, color="tab:red", linestyle="--", linewidth=1)
    slo = summaries[0]["slo"] if summaries else {"ttft_ms": 0, "itl_ms": 0}
    a.set_title(f"SLO attainment (TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['itl_ms']:g} ms)",
                fontsize=9)
    a.set_ylabel("% of requests", fontsize=8)
    a.set_ylim(0, 102)
    b.set_title("Goodput", fontsize=9)
    b.set_ylabel("req/s meeting both SLOs", fontsize=8)
    for ax in (a, b):
        ax.set_xlabel("request rate (req/s, Poisson)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _sustained(s: dict) -> float:
    return s.get("max_rate_interpolated") or 0.0


def comparison_table(summaries: list[dict], baseline: str | None = None) -> str:
    """Each sweep's highest sustained rate and its ratio to the baseline sweep's."""
    base = next((s for s in summaries if s["label"] == baseline), None)
    if base is None:
        mixed = [s for s in summaries if s["label"].startswith("mixed")]
        base = max(mixed, key=_sustained) if mixed else (summaries[0] if summaries else None)
    pct = f"{100 * summaries[0]['target']:g}%" if summaries else ""
    lines = [f"{'sweep':<24}{'rate @' + pct:>10}{'interp.':>9}{'max goodput':>13}"
             f"{'x ' + (base['label'] if base else '-'):>18}"]
    for s in summaries:
        best = s["max_rate"]
        ratio = "-"
        if base is not None and _sustained(base) > 0:
            ratio = f"{_sustained(s) / _sustained(base):.2f}"
        lines.append(f"{s['label']:<24}{(f'{best:g}' if best else 'none'):>10}"
                     f"{_sustained(s):>9.2f}{s['max_goodput']:>13.2f}{ratio:>18}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.serve_sweep_plot",
                                description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", metavar="REPORT[=LABEL]")
    p.add_argument("-o", "--output", default=None, help="PNG to write")
    p.add_argument("--baseline", default=None, help="label the ratios are taken against")
    args = p.parse_args(argv)
    try:
        summaries = [load_summary(r) for r in args.reports]
    except (OSError, ValueError, KeyError) as e:
        print(f"serve_sweep_plot: error: {e}", file=sys.stderr)
        return 2
    print(comparison_table(summaries, args.baseline))
    if args.output:
        print(f"wrote {plot_attainment(args.output, summaries)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
