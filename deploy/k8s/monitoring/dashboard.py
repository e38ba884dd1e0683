"""Writes pdserve-dashboard.json, the Grafana dashboard over the router's /metrics.

    python deploy/k8s/monitoring/dashboard.py     (a test fails when the JSON is stale)

Every query reads metrics the router exports: its own request/latency series and the load each
worker reports by heartbeat (pdserve_worker_*{address, role}).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("pdserve-dashboard.json")
RATE = "[$__rate_interval]"
# KV bytes one token occupies on the wire: 2 (K, V) x layers x kv heads x head dim x dtype
# bytes. The default is Llama-3-8B in bf16; set it for your model on the dashboard.
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def _quantiles(metric: str, by: str = "", match: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return [((f"histogram_quantile({q}, sum by ({group}) "
             f"(rate({metric}_bucket{match}{RATE})))"), f"{legend}p{int(q * 100)}")
            for q in (0.5, 0.9, 0.99)]


# (title, unit, [(expr, legend)]) per row.
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Latency", [
        ("Time to first token", "s", _quantiles("pdserve_router_ttft_seconds")),
        ("Inter-token latency", "s", _quantiles("pdserve_router_itl_seconds")),
        ("Stage time p90 (queue, bootstrap, prefill, transfer, decode)", "s", [
            (("histogram_quantile(0.9, sum by (le, stage) "
             f"(rate(pdserve_router_stage_seconds_bucket{RATE})))"), "{{stage}}")]),
    ]),
    ("Throughput", [
        ("Tokens per second", "short", [
            (f"sum(rate(pdserve_router_generation_tokens_total{RATE}))", "generated"),
            (f"sum(rate(pdserve_router_prompt_tokens_total{RATE}))", "prompt"),
            (f"sum(rate(pdserve_router_cached_tokens_total{RATE}))", "prompt from cache")]),
        ("Requests per second", "reqps", [
            (f"sum by (endpoint) (rate(pdserve_router_requests_total{RATE}))", "{{endpoint}}"),
            (f"sum by (reason) (rate(pdserve_router_finished_total{RATE}))",
             "finished: {{reason}}")]),
    ]),
    ("Queues and KV", [
        ("Queue depth by role", "short", [
            ("sum by (role) (pdserve_worker_num_waiting)", "{{role}} waiting"),
            ("sum by (role) (pdserve_worker_num_running)", "{{role}} running"),
            ("sum by (role) (pdserve_worker_num_inflight)", "{{role}} KV in flight")]),
        ("Queue depth by worker", "short", [
            ("pdserve_worker_num_waiting", "{{role}} {{address}}")]),
        ("KV usage by role", "percentunit", [
            (("sum by (role) (pdserve_worker_kv_pages_in_use) / "
             "clamp_min(sum by (role) (pdserve_worker_kv_pages_total), 1)"), "{{role}} in use"),
            (("sum by (role) (pdserve_worker_kv_pages_cached) / "
             "clamp_min(sum by (role) (pdserve_worker_kv_pages_total), 1)"),
             "{{role}} radix cache")]),
        ("KV usage by worker", "percentunit", [
            ("pdserve_worker_kv_pages_in_use / clamp_min(pdserve_worker_kv_pages_total, 1)",
             "{{role}} {{address}}")]),
    ]),
    ("KV transfer", [
        ("Transfer latency", "s",
         _quantiles("pdserve_router_stage_seconds", match='{stage="transfer"}')
         + [(("histogram_quantile(0.9, sum by (le) (rate(pdserve_router_stage_seconds_bucket"
             f'{{stage="bootstrap"}}{RATE})))'), "bootstrap p90")]),
        ("Transfer GB/s (prompt KV bytes; set kv_bytes_per_token)", "decgbytes", [
            (f"sum(rate(pdserve_router_prompt_tokens_total{RATE})) * $kv_bytes_per_token / 1e9",
             "moved, all transfers"),
            ((f"sum(rate(pdserve_router_prompt_tokens_total{RATE})) * $kv_bytes_per_token / 1e9 "
             "/ clamp_min(sum(rate(pdserve_router_stage_seconds_sum"
             f'{{stage="transfer"}}{RATE})), 1e-9)'), "per transfer")]),
    ]),
    ("Failures", [
        ("Failed requests per second", "reqps", [
            (("sum by (endpoint, status) (rate(pdserve_router_requests_total"
             f'{{status!~"2..|OK"}}{RATE}))'), "{{endpoint}} {{status}}"),
            (f"sum(rate(pdserve_router_retries_total{RATE}))", "retried on a fresh pair"),
            (("sum by (reason) (rate(pdserve_router_finished_total"
             f'{{reason=~"abort|error"}}{RATE}))'), "finished: {{reason}}")]),
        ("Workers in rotation", "short", [
            ("sum by (role) (pdserve_router_worker_healthy)", "{{role}} healthy"),
            ("count by (role) (pdserve_router_worker_healthy == 0)", "{{role}} out")]),
    ]),
]


def _panel(pid: int, title: str, unit: str, targets: list[tuple[str, str]], x: int,
           y: int) -> dict:
    return {
        "id": pid, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom",
                               "calcs": ["mean", "max"]}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    panels: list[dict] = []
    y = 0
    for row_title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": row_title,
                       "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                       "panels": []})
        y += 1
        for i, (title, unit, targets) in enumerate(row):
            panels.append(_panel(len(panels) + 1, title, unit, targets, 12 * (i % 2), y))
            y += 8 if i % 2 else 0
        y += 8 if len(row) % 2 else 0
    return {
        "uid": "pdserve", "title": "pdserve", "tags": ["pdserve", "llm"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Prometheus"},
            {"name": "kv_bytes_per_token", "type": "textbox", "label": "KV bytes per token",
             "query": str(KV_BYTES_PER_TOKEN),
             "current": {"text": str(KV_BYTES_PER_TOKEN), "value": str(KV_BYTES_PER_TOKEN)}},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
