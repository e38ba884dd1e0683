"""deploy/Dockerfile: one image for every role, CUDA base with FlashInfer and ucxx, non-root,
`pdserve` as the entrypoint (behind tini, which forwards the SIGTERM that drains a worker)."""

from __future__ import annotations

import json
import re

from test_deploy_manifests import ROOT

DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_cuda_base_with_flashinfer_and_ucxx():
    ins = _instructions()
    assert re.search(r"CUDA_IMAGE=nvidia/cuda:\S+-devel-", DOCKERFILE)
    assert [r for op, r in ins if op == "FROM"][-1] == "${CUDA_IMAGE}"
    assert any(op == "RUN" and '".[gpu,ucx,nixl]"' in r for op, r in ins)


def test_non_root_and_pdserve_entrypoint():
    ins = _instructions()
    users = [r for op, r in ins if op == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    entry = json.loads([r for op, r in ins if op == "ENTRYPOINT"][-1])
    assert entry[-1] == "pdserve" and "tini" in entry[0]


def test_manifests_run_as_the_image_user():
    from test_deploy_manifests import by_kind, rendered

    uid = [r for op, r in _instructions() if op == "USER"][-1].split(":")[0]
    for dep in by_kind(rendered("xpyd"), "Deployment").values():
        ctx = dep["spec"]["template"]["spec"]["securityContext"]
        assert ctx["runAsNonRoot"] and str(ctx["runAsUser"]) == uid


def test_build_context_ignores_local_state():
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignore)
