"""deploy/k8s/monitoring: the dashboard, the Prometheus adapter rules and the autoscalers read
only metrics the router really exports, under the names Prometheus gives them."""

from __future__ import annotations

import importlib.util
import json
import re
from types import SimpleNamespace

import pytest
from test_deploy_manifests import K8S, OVERLAYS, by_kind, load_docs, rendered

MON = K8S / "monitoring"
NAME = re.compile(r"\bpdserve_[a-z_]+")


def _dashboard_module():
    spec = importlib.util.spec_from_file_location("pdserve_dashboard", MON / "dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exported() -> set[str]:
    """Sample names of a router's /metrics once every metric has a sample."""
    parse = pytest.importorskip("prometheus_client.parser").text_string_to_metric_families

    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.router.events import TIMING_FIELDS, Usage
    from pdserve.router.metrics import RouterMetrics

    worker = SimpleNamespace(address="10.0.0.1:50061", role="decode", state="healthy", inflight=1,
                             queued=0, load=pb.WorkerLoad(num_waiting=2, kv_pages_total=8))
    m = RouterMetrics(SimpleNamespace(all=lambda: [worker]))
    m.on_request("completions", 200)
    m.on_first_token(0.1)
    m.on_tokens(0.02, 2)
    m.on_retry()
    m.on_finish("stop", Usage(5, 2, 1), dict.fromkeys(TIMING_FIELDS, 1.0))
    return {s.name for fam in parse(m.render().decode())
            for s in fam.samples}


def _dashboard_exprs() -> list[str]:
    dash = json.loads((MON / "pdserve-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_json_is_fresh():
    assert _dashboard_module().render() == (MON / "pdserve-dashboard.json").read_text(), \
        "stale: run python deploy/k8s/monitoring/dashboard.py"


def test_dashboard_covers_the_issue():
    dash = json.loads((MON / "pdserve-dashboard.json").read_text())
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for what in ("first token", "inter-token", "tokens per second", "queue depth", "kv usage",
                 "gb/s", "transfer latency", "failed"):
        assert what in titles, what
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_reads_exported_metrics():
    exported = _exported()
    used = {n for e in _dashboard_exprs() for n in NAME.findall(e)}
    assert used and used <= exported, sorted(used - exported)


def test_adapter_rules_read_exported_metrics_and_feed_the_hpas():
    yaml = pytest.importorskip("yaml")
    values = yaml.safe_load((MON / "prometheus-adapter-values.yaml").read_text())
    exported = _exported()
    served = set()
    for rule in values["rules"]["external"]:
        used = set(NAME.findall(rule["seriesQuery"] + rule["metricsQuery"]))
        assert used <= exported, sorted(used - exported)
        assert re.fullmatch(rule["name"]["matches"], NAME.findall(rule["seriesQuery"])[0])
        served.add(rule["name"]["as"])
    for overlay in OVERLAYS:
        for hpa in by_kind(rendered(overlay), "HorizontalPodAutoscaler").values():
            for metric in hpa["spec"]["metrics"]:
                assert metric["external"]["metric"]["name"] in served


def test_grafana_configmap_ships_the_dashboard():
    kust = load_docs(MON / "kustomization.yaml")[0]
    files = [f for g in kust["configMapGenerator"] for f in g["files"]]
    assert files == ["pdserve-dashboard.json"]
    assert kust["generatorOptions"]["labels"] == {"grafana_dashboard": "1"}
