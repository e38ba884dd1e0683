"""`pdserve bench` plots (matplotlib, Agg): small PNGs for reports and docs.

latency_cdf.png: empirical CDFs of TTFT and ITL. timeline.png: output tokens/s and finished
requests/s over time, and queue depth (waiting + running) per worker role from /workers.
"""

from __future__ import annotations

import os

import numpy as np

from pdserve.bench.serve_client import RequestResult
from pdserve.bench.serve_metrics import itls_ms, ttft_ms

DPI = 80


def _pyplot():  # noqa: ANN202 - matplotlib has no stable stub type
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], title: str, slo_ms: float | None) -> None:  # noqa: ANN001
    if values:
        x = np.sort(np.asarray(values))
        y = np.arange(1, x.size + 1) / x.size
        ax.step(x, y, where="post", color="tab:blue")
    if slo_ms is not None:
        ax.axvline(slo_ms, color="tab:red", linestyle="--", linewidth=1, label="SLO")
        ax.legend(loc="lower right", fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("ms", fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)


def plot_latency_cdf(path: str, results: list[RequestResult], slo_ttft_ms: float,
                     slo_itl_ms: float) -> str:
    plt = _pyplot()
    ok = [r for r in results if r.ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 2.6), dpi=DPI)
    _cdf(a, [ttft_ms(r) for r in ok], "TTFT CDF", slo_ttft_ms)
    _cdf(b, [g for r in ok for g in itls_ms(r)], "ITL CDF (per token)", slo_itl_ms)
    a.set_ylabel("fraction", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_timeline(path: str, timeline: dict) -> str:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 3.6), dpi=DPI, sharex=True)
    t = [x + timeline["bin_s"] / 2 for x in timeline["t_s"]]
    a.plot(t, timeline["output_tok_s"], color="tab:blue", label="output tok/s")
    a.set_ylabel("tok/s", fontsize=8)
    a2 = a.twinx()
    a2.plot(t, timeline["requests_s"], color="tab:orange", label="finished req/s")
    a2.set_ylabel("req/s", fontsize=8)
    a.set_title("Throughput over time", fontsize=9)
    for ax in (a, a2):
        ax.tick_params(labelsize=7)
    a.grid(alpha=0.3)
    queue = timeline["queue"]
    roles = sorted({k for q in queue for k in q if k != "t_s"})
    for role in roles:
        b.step([q["t_s"] for q in queue], [q.get(role, 0) for q in queue], where="post",
               label=role)
    b.set_title("Queue depth (waiting + running), from /workers", fontsize=9)
    b.set_xlabel("seconds since start", fontsize=8)
    b.tick_params(labelsize=7)
    b.grid(alpha=0.3)
    if roles:
        b.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def write_plots(out_dir: str, results: list[RequestResult], timeline: dict, slo_ttft_ms: float,
                slo_itl_ms: float) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    return [plot_latency_cdf(os.path.join(out_dir, "latency_cdf.png"), results, slo_ttft_ms,
                             slo_itl_ms),
            plot_timeline(os.path.join(out_dir, "timeline.png"), timeline)]
