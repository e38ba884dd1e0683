"""Worker discovery from a Kubernetes label selector (`pdserve router --discovery k8s`).

The router lists the pods matching the selector through the Kubernetes API every interval and
keeps the registry equal to the Ready ones: a pod that becomes Ready joins at
`podIP:<grpc port>` with the role from its role label, a pod that stops being Ready or
disappears leaves at once. Credentials are the pod's service account (token, CA, namespace
under /var/run/secrets/kubernetes.io/serviceaccount) unless given explicitly. It needs RBAC
get/list on pods in the namespace (deploy/k8s/base/router-rbac.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
ROLES = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class K8sDiscoveryConfig:
    selector: str  # e.g. "app.kubernetes.io/name=pdserve"
    namespace: str | None = None  # default: the service account's namespace
    api_url: str | None = None  # default: https://$KUBERNETES_SERVICE_HOST:$..._PORT
    role_label: str = "app.kubernetes.io/component"  # values prefill|decode|mixed
    grpc_port: int = 50051  # used when the pod names no container port "grpc"
    interval_s: float = 2.0
    token_file: str = f"{SA_DIR}/token"
    ca_file: str | None = f"{SA_DIR}/ca.crt"

    def __post_init__(self) -> None:
        if not self.selector:
            raise ValueError("k8s_selector: required with --discovery k8s")
        if self.interval_s <= 0:
            raise ValueError(f"k8s_interval: must be positive, got {self.interval_s}")

    def resolved_api_url(self) -> str:
        if self.api_url:
            return self.api_url.rstrip("/")
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
            "KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("k8s_api: not in a pod (no KUBERNETES_SERVICE_HOST); pass --k8s-api")
        return f"https://{host}:{port}"

    def resolved_namespace(self) -> str:
        if self.namespace:
            return self.namespace
        try:
            with open(f"{SA_DIR}/namespace", encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError:
            raise ValueError("k8s_namespace: not in a pod; pass --k8s-namespace") from None


def ready_workers(pods: dict, cfg: K8sDiscoveryConfig) -> dict[str, tuple[str, str]]:
    """PodList JSON -> {worker_id: (role, "ip:port")} for Ready pods with a known role."""
    out: dict[str, tuple[str, str]] = {}
    for pod in pods.get("items", []):
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        role = (meta.get("labels") or {}).get(cfg.role_label)
        ip = status.get("podIP")
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
        if role not in ROLES or not ip or not ready or meta.get("deletionTimestamp"):
            continue
        port = cfg.grpc_port
        for c in pod.get("spec", {}).get("containers", []):
            for p in c.get("ports") or []:
                if p.get("name") == "grpc":
                    port = int(p["containerPort"])
        out[f"k8s-{meta.get('name', ip)}"] = (role, f"{ip}:{port}")
    return out


class K8sDiscovery:
    def __init__(self, registry, cfg: K8sDiscoveryConfig) -> None:
        self.registry = registry
        self.cfg = cfg
        self._task: asyncio.Task | None = None
        self._known: dict[str, tuple[str, str]] = {}

    async def start(self) -> None:
        cfg = self.cfg
        headers = {}
        if os.path.exists(cfg.token_file):
            with open(cfg.token_file, encoding="utf-8") as fh:
                headers["Authorization"] = f"Bearer {fh.read().strip()}"
        verify: str | bool = cfg.ca_file if cfg.ca_file and os.path.exists(cfg.ca_file) else True
        self._client = httpx.AsyncClient(base_url=cfg.resolved_api_url(), headers=headers,
                                         verify=verify, timeout=10.0)
        self._path = f"/api/v1/namespaces/{cfg.resolved_namespace()}/pods"
        await self.sync_once()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if hasattr(self, "_client"):
            await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self.sync_once()

    async def sync_once(self) -> None:
        try:
            resp = await self._client.get(self._path, params={"labelSelector": self.cfg.selector})
            resp.raise_for_status()
            want = ready_workers(resp.json(), self.cfg)
        except (httpx.HTTPError, ValueError) as e:  # keep the last view; the API may blip
            log.warning("kubernetes pod list failed: %s", e)
            return
        for wid in [w for w in self._known if want.get(w) != self._known[w]]:
            self.registry.remove_discovered(wid)
            del self._known[wid]
        for wid, (role, addr) in want.items():
            if wid not in self._known:
                self.registry.add_discovered(wid, role, addr)
                self._known[wid] = (role, addr)
                log.info("discovered %s worker %s at %s", role, wid, addr)
