"""The goodput comparison's table: one row per set-up, and the two checks the comparison is for.

Rows are goodput.json entries (bench/goodput_gpu.py): name, status, ready_s, spatial, the sweep
summary (serve_goodput.sweep_summary), the decode step at the sustained batch. The checks:
- spatial goodput (the interpolated highest rate meeting the SLOs for 90% of requests) at
  least `GOODPUT_RATIO` times the best colocated (`mixed`) set-up's;
- at the spatial set-up's highest sustained rate, ITL p99 within `ITL_RATIO` of its own decode
  step at that rate's decode batch.
"""

from __future__ import annotations

GOODPUT_RATIO = 2.0
ITL_RATIO = 1.5


def _sustained(row: dict) -> float:
    sweep = row.get("sweep") or {}
    return float(sweep.get("max_rate_interpolated") or 0.0)


def _point_at_best(row: dict) -> dict | None:
    sweep = row.get("sweep") or {}
    best = sweep.get("max_rate")
    return next((p for p in sweep.get("points", []) if p["rate"] == best), None)


def itl_ratio(row: dict) -> float | None:
    point = _point_at_best(row)
    step = row.get("step_ms")
    if point is None or not step:
        return None
    return point["itl_p99_ms"] / step


def checks(rows: list[dict]) -> list[str]:
    spatial = [r for r in rows if r["kind"] == "spatial" and _sustained(r) > 0]
    mixed = [r for r in rows if r["kind"] == "mixed" and r.get("sweep")]
    out = []
    if spatial and mixed:
        s = max(spatial, key=_sustained)
        m = max(mixed, key=_sustained)
        if _sustained(m) > 0:
            ratio = _sustained(s) / _sustained(m)
            verdict = "met" if ratio >= GOODPUT_RATIO else "NOT met"
            out.append(f"goodput {s['name']} / {m['name']}: {_sustained(s):.2f} / "
                       f"{_sustained(m):.2f} req/s = {ratio:.2f}x (target >= "
                       f"{GOODPUT_RATIO:g}x: {verdict})")
        else:
            out.append(f"goodput: {m['name']} sustained no rate; {s['name']} "
                       f"{_sustained(s):.2f} req/s")
    else:
        out.append("goodput ratio: needs a spatial and a mixed sweep (this run or another: "
                   "python -m pdserve.bench.serve_sweep_plot DIR/NAME ...)")
    for s in spatial:
        ratio = itl_ratio(s)
        if ratio is None:
            out.append(f"ITL p99 / decode step ({s['name']}): not measured")
            continue
        verdict = "met" if ratio <= ITL_RATIO else "NOT met"
        point = _point_at_best(s) or {}
        out.append(f"ITL p99 / decode step ({s['name']} at {point.get('rate', 0):g} req/s, "
                   f"batch {s['step_batch']}): {point.get('itl_p99_ms', 0):.2f} / "
                   f"{s['step_ms']:.2f} ms = {ratio:.2f} (target <= {ITL_RATIO:g}: {verdict})")
    return out


def format_table(rows: list[dict], target: float = 0.9) -> str:
    pct = f"{100 * target:g}%"
    head = (f"{'set-up':<22}{'ready s':>8}{'rates run':>18}{'rate @' + pct:>11}{'interp.':>8}"
            f"{'goodput':>8}{'ITL p99':>8}{'batch':>6}{'step ms':>8}  status")
    lines = ["=" * len(head), head]
    for r in rows:
        sweep = r.get("sweep") or {}
        pts = sweep.get("points", [])
        run = "/".join(f"{p['rate']:g}" for p in pts) or "-"
        point = _point_at_best(r) or {}
        best = sweep.get("max_rate")
        ready = f"{r['ready_s']:.0f}" if r.get("ready_s") is not None else "-"
        step = f"{r['step_ms']:.2f}" if r.get("step_ms") else "-"
        status = r["status"] + (f" [{'; '.join(r['notes'])}]" if r.get("notes") else "")
        if r.get("spatial"):
            status += f" (SM split prefill/decode {r['spatial']})"
        lines.append(
            f"{r['name']:<22}{ready:>8}{run[-17:]:>18}"
            f"{(f'{best:g}' if best is not None else 'none' if pts else '-'):>11}"
            f"{_sustained(r):>8.2f}{float(sweep.get('max_goodput') or 0):>8.2f}"
            f"{point.get('itl_p99_ms', 0):>8.2f}{point.get('batch_mean', 0):>6.1f}{step:>8}"
            f"  {status}")
    lines.append("-" * len(head))
    lines += checks(rows)
    lines.append("=" * len(head))
    return "\n".join(lines)
