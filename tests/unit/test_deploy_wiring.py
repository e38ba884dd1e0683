"""deploy/k8s: what the manifests tell pdserve is what pdserve accepts, and the pieces agree.

Each container's args are expanded the way the kubelet does ($(VAR) from the container's env,
resolved through the ConfigMap, a Secret stand-in and the downward API) and parsed by that
role's real argparse parser; ports, probes, selectors and names are cross-checked.
"""

from __future__ import annotations

import re

import pytest
from test_deploy_manifests import K8S, OVERLAYS, ROOT, by_kind, rendered

ROLES = ("prefill", "decode", "mixed")
POD_IP = "10.1.2.3"


def _parser(role: str):
    if role == "router":
        from pdserve.router.main import build_parser

        return build_parser()
    from pdserve.kvtransfer.config import add_transfer_args
    from pdserve.worker.main import parser

    return parser(role, add_transfer_args)


def _env(container: dict, config: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        if "configMapRef" in ref:
            assert ref["configMapRef"]["name"] == "pdserve-config"
            env.update(config)
    for e in container.get("env", []):
        src = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            assert ref["name"] == "pdserve-config" and ref["key"] in config, ref
            env[e["name"]] = config[ref["key"]]
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            assert ref["name"] == "pdserve-secrets", ref
            assert ref["key"] in ("api-key", "registration-secret"), ref
            env[e["name"]] = f"secret-{ref['key']}"
        elif "fieldRef" in src:
            assert src["fieldRef"]["fieldPath"] == "status.podIP"
            env[e["name"]] = POD_IP
        else:
            raise AssertionError(f"unhandled env source {e}")
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"{arg}: ${m.group(1)} is not in the container's env"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def _containers(overlay: str):
    docs = rendered(overlay)
    config = by_kind(docs, "ConfigMap")["pdserve-config"]["data"]
    for dep in by_kind(docs, "Deployment").values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            role = c["args"][0]
            args = _parser(role).parse_args([_expand(a, _env(c, config)) for a in c["args"][1:]])
            yield dep, c, role, args


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_is_accepted_by_its_role(overlay: str):
    roles = set()
    for dep, _c, role, args in _containers(overlay):
        roles.add(role)
        assert role in ROLES + ("router",), role
        assert dep["metadata"]["name"] == f"pdserve-{role}"
        assert args.model and args.model.startswith("/"), args.model
        assert args.registration_secret == "secret-registration-secret"
        if role == "router":
            assert args.api_key == "secret-api-key"
    assert {"router", "prefill", "decode"} <= roles


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_and_probes_agree(overlay: str):
    for _dep, c, role, args in _containers(overlay):
        ports = _ports(c)
        if role == "router":
            assert args.host == "0.0.0.0"
            assert (ports["http"], ports["grpc"]) == (args.port, args.grpc_port)
        else:
            # Bind and advertise the pod IP: the router and decode peers dial this address.
            assert args.host == POD_IP
            assert ports["grpc"] == args.port != 0
            if role == "prefill":
                assert ports["bootstrap"] == args.bootstrap_port != 0
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            assert set(probe) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, kind
            assert probe["grpc"]["port"] == ports["grpc"], (role, kind)
            assert probe["grpc"].get("service", "") in ("", "pdserve.v1.Worker")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_register_through_the_router_service(overlay: str):
    docs = rendered(overlay)
    svc = by_kind(docs, "Service")["pdserve-router"]
    router = by_kind(docs, "Deployment")["pdserve-router"]
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    pod_ports = _ports(router["spec"]["template"]["spec"]["containers"][0])
    for name, p in svc_ports.items():
        assert p["targetPort"] in (name, pod_ports[name]) and name in pod_ports
    for _dep, _c, role, args in _containers(overlay):
        if role != "router":
            host, port = args.router.rsplit(":", 1)
            assert host in (svc["metadata"]["name"],
                            f"{svc['metadata']['name']}.{svc['metadata'].get('namespace')}")
            assert int(port) == svc_ports["grpc"]["port"]


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_pick_exactly_their_pods(overlay: str):
    docs = rendered(overlay)
    deps = by_kind(docs, "Deployment")
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deps.items()}
    for name, dep in deps.items():
        sel = dep["spec"]["selector"]["matchLabels"]
        assert [n for n, lab in pods.items() if _matches(sel, lab)] == [name]
    svc = by_kind(docs, "Service")["pdserve-router"]
    assert [n for n, lab in pods.items() if _matches(svc["spec"]["selector"], lab)] == \
        ["pdserve-router"]
    for name, pdb in by_kind(docs, "PodDisruptionBudget").items():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert [n for n, lab in pods.items() if _matches(sel, lab)] == [name]
    for mon in by_kind(docs, "ServiceMonitor").values():
        assert mon["apiVersion"] == "monitoring.coreos.com/v1"
        assert _matches(mon["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
        names = {p["name"] for p in svc["spec"]["ports"]}
        for ep in mon["spec"]["endpoints"]:
            assert ep["port"] in names and ep["path"] == "/metrics"
    for name, hpa in by_kind(docs, "HorizontalPodAutoscaler").items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] == name in deps
        role = name.removeprefix("pdserve-")
        for m in hpa["spec"]["metrics"]:
            assert m["external"]["metric"]["selector"]["matchLabels"] == {"role": role}
        assert deps[name]["spec"]["replicas"] >= hpa["spec"]["minReplicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_drain_before_they_go(overlay: str):
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    for dep, c, role, args in _containers(overlay):
        if role == "router":
            continue
        spec = dep["spec"]["template"]["spec"]
        hook = c["lifecycle"]["preStop"]["exec"]["command"]
        assert hook == ["/opt/pdserve/bin/prestop-drain.sh"]
        assert (ROOT / "deploy" / "prestop-drain.sh").stat().st_mode & 0o111
        assert "COPY deploy/prestop-drain.sh /opt/pdserve/bin/prestop-drain.sh" in dockerfile
        # requests, then KV transfers, each up to --drain-timeout
        assert spec["terminationGracePeriodSeconds"] > 2 * args.drain_timeout
        gpu = c["resources"]["limits"]["nvidia.com/gpu"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == gpu and int(gpu) >= 1
        assert args.device == "cuda"
        assert args.tp == int(gpu)  # one pod holds its worker's ranks, one GPU each


def test_secret_example_has_the_keys_the_pods_read():
    from test_deploy_manifests import load_docs

    secret = load_docs(K8S / "secret.example.yaml")[0]
    assert secret["metadata"]["name"] == "pdserve-secrets"
    assert set(secret["stringData"]) == {"api-key", "registration-secret"}
