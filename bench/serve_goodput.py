"""Goodput over a rate sweep: one point per request rate, and the highest rate the SLOs hold at.

A point is one run at one Poisson rate. `attainment` is the share of the requests *sent* that
met both SLOs (TTFT <= --slo-ttft and TPOT <= --slo-itl; a failed request misses them), and
`goodput` those requests per second of the run. The sweep's answer (DistServe's goodput) is
the highest measured rate whose attainment reaches the target (0.9 by default), and an
estimate between that rate and the next measured one by linear interpolation of attainment.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SweepPoint:
    rate: float  # requests/s asked for
    sent: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    goodput: float  # requests/s that met both SLOs
    attainment: float  # share of the requests sent that met both SLOs
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    itl_p99_ms: float
    batch_mean: float = 0.0  # decode (or mixed) requests running, averaged over the run

    @classmethod
    def from_summary(cls, rate: float, s: dict) -> SweepPoint:
        return cls(rate=rate, sent=s["completed"] + s["failed"], completed=s["completed"],
                   failed=s["failed"], duration_s=s["duration_s"],
                   request_throughput=s["request_throughput"],
                   output_throughput=s["output_throughput"], goodput=s["goodput"],
                   attainment=s["slo_attainment"], ttft_p50_ms=s["ttft_ms"]["p50"],
                   ttft_p99_ms=s["ttft_ms"]["p99"], tpot_p50_ms=s["tpot_ms"]["p50"],
                   tpot_p99_ms=s["tpot_ms"]["p99"], itl_p99_ms=s["itl_ms"]["p99"],
                   batch_mean=sum(v for k, v in s.get("mean_running", {}).items()
                                  if k in ("decode", "mixed")))

    def to_json(self) -> dict:
        return asdict(self)


def parse_rates(text: str) -> tuple[float, ...]:
    """`"1,2,4.5"` -> (1.0, 2.0, 4.5): finite, positive, strictly increasing."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"sweep_rates: expected R1,R2,... (requests/s), got {text!r}") from None
    if not rates:
        raise ValueError(f"sweep_rates: no rate in {text!r}")
    check_rates(rates)
    return rates


def check_rates(rates: tuple[float, ...]) -> None:
    for r in rates:
        if not (math.isfinite(r) and r > 0):
            raise ValueError(f"sweep_rates: each rate must be finite and > 0, got {r}")
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"sweep_rates: rates must increase, got {list(rates)}")


def requests_at(rate: float, num_prompts: int, duration_s: float) -> int:
    """Requests sent at `rate`: `num_prompts`, or about `duration_s` seconds of arrivals."""
    if duration_s <= 0:
        return num_prompts
    return max(1, round(rate * duration_s))


def max_rate_meeting(points: list[SweepPoint], target: float) -> float | None:
    """The highest measured rate with attainment >= target (None when none reaches it)."""
    ok = [p.rate for p in points if p.attainment >= target]
    return max(ok) if ok else None


def interpolated_rate(points: list[SweepPoint], target: float) -> float | None:
    """Where attainment crosses `target` above the highest passing rate, by linear
    interpolation towards the next measured rate; that rate itself when none is above it."""
    best = max_rate_meeting(points, target)
    if best is None:
        return None
    ordered = sorted(points, key=lambda p: p.rate)
    above = [p for p in ordered if p.rate > best]
    if not above:
        return best
    lo = next(p for p in ordered if p.rate == best)
    hi = above[0]
    if lo.attainment == hi.attainment:
        return best
    frac = (lo.attainment - target) / (lo.attainment - hi.attainment)
    return lo.rate + min(1.0, max(0.0, frac)) * (hi.rate - lo.rate)


def sweep_summary(points: list[SweepPoint], target: float, slo_ttft_ms: float,
                  slo_itl_ms: float, label: str = "") -> dict:
    return {"label": label, "target": target,
            "slo": {"ttft_ms": slo_ttft_ms, "itl_ms": slo_itl_ms},
            "max_rate": max_rate_meeting(points, target),
            "max_rate_interpolated": interpolated_rate(points, target),
            "max_goodput": max((p.goodput for p in points), default=0.0),
            "points": [p.to_json() for p in points]}


def points_from_json(summary: dict) -> list[SweepPoint]:
    return [SweepPoint(**p) for p in summary["points"]]


def format_sweep_table(summary: dict) -> str:
    slo = summary["slo"]
    head = (f"{'rate':>7}{'sent':>6}{'fail':>6}{'req/s':>8}{'tok/s':>9}{'goodput':>9}"
            f"{'attain':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'ITL p99':>9}"
            f"{'batch':>7}")
    title = (f" Rate sweep {summary['label'] or ''} (TTFT <= {slo['ttft_ms']:g} ms, "
             f"TPOT <= {slo['itl_ms']:g} ms) ")
    lines = [f"{title:=^{len(head)}}", head]
    for p in points_from_json(summary):
        lines.append(f"{p.rate:>7.3g}{p.sent:>6}{p.failed:>6}{p.request_throughput:>8.2f}"
                     f"{p.output_throughput:>9.0f}{p.goodput:>9.2f}{100 * p.attainment:>7.0f}%"
                     f"{p.ttft_p50_ms:>10.1f}{p.ttft_p99_ms:>9.1f}{p.tpot_p50_ms:>10.2f}"
                     f"{p.tpot_p99_ms:>8.2f}{p.itl_p99_ms:>9.2f}{p.batch_mean:>7.1f}")
    best, interp = summary["max_rate"], summary["max_rate_interpolated"]
    pct = f"{100 * summary['target']:g}%"
    if best is None:
        lines.append(f"no measured rate reached {pct} attainment")
    else:
        lines.append(f"highest rate with >= {pct} attainment: {best:g} req/s "
                     f"(interpolated {interp:.2f} req/s)")
    lines.append("=" * len(head))
    return "\n".join(lines)
