"""`pdserve router --discovery k8s`: workers come and go with the Ready pods of a label
selector. The Kubernetes API is a small stand-in on loopback serving a PodList; the workers and
the router are real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from pdserve.router.k8s_discovery import K8sDiscoveryConfig, ready_workers


def _pod(name: str, role: str, port: int, ready: bool = True) -> dict:
    labels = {"app": "pdserve", "app.kubernetes.io/component": role}
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"ports": [{"name": "grpc", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "phase": "Running",
                       "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_ready_workers_keeps_only_ready_pods_with_a_role():
    cfg = K8sDiscoveryConfig(selector="app=pdserve")
    pods = {"items": [_pod("p0", "prefill", 7000), _pod("d0", "decode", 7001, ready=False),
                      {**_pod("x", "router", 7002)}, _pod("m0", "mixed", 7003)]}
    assert ready_workers(pods, cfg) == {"k8s-p0": ("prefill", "127.0.0.1:7000"),
                                        "k8s-m0": ("mixed", "127.0.0.1:7003")}


class _FakeApi:
    """Serves GET /api/v1/namespaces/<ns>/pods?labelSelector=... from a mutable PodList."""

    def __init__(self) -> None:
        self.pods: list[dict] = []
        self.selectors: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                url = urlparse(self.path)
                api.selectors += parse_qs(url.query).get("labelSelector", [])
                ok = url.path == "/api/v1/namespaces/ns/pods"
                body = json.dumps({"kind": "PodList", "items": api.pods} if ok else {}).encode()
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _start(argv: list[str], prefix: str) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", *argv], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(f"{prefix} ready"):
            return proc, dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
    proc.kill()
    raise RuntimeError(f"{argv[0]} did not start")


def _workers(http: str) -> dict[str, str]:
    with urllib.request.urlopen(f"{http}/workers", timeout=10) as resp:
        return {w["worker_id"]: w["state"] for w in json.load(resp)["workers"]}


def _wait(pred, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(600)
def test_router_follows_ready_pods(tiny_model_dir):
    api = _FakeApi()
    procs: list[subprocess.Popen] = []
    try:
        for role in ("prefill", "decode"):
            p, ready = _start([role, "--model", tiny_model_dir, "--threads", "1"], "worker")
            procs.append(p)
            api.pods.append(_pod(f"{role}-0", role, int(ready["grpc"].rsplit(":", 1)[1])))
        router, ready = _start(["router", "--model", tiny_model_dir, "--discovery", "k8s",
                                "--k8s-api", api.url, "--k8s-namespace", "ns",
                                "--k8s-selector", "app=pdserve", "--k8s-interval", "0.3",
                                "--health-check-interval", "0.5"], "router")
        procs.append(router)
        http = ready["http"]
        assert _wait(lambda: _workers(http) == {"k8s-prefill-0": "healthy",
                                                "k8s-decode-0": "healthy"}), _workers(http)
        assert "app=pdserve" in api.selectors
        body = json.dumps({"model": json.load(urllib.request.urlopen(f"{http}/v1/models"))[
            "data"][0]["id"], "prompt": "hello", "max_tokens": 3}).encode()
        req = urllib.request.Request(f"{http}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 3
        api.pods[1] = _pod("decode-0", "decode", 1, ready=False)  # the pod stops being Ready
        assert _wait(lambda: "k8s-decode-0" not in _workers(http), 30), _workers(http)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        api.server.shutdown()
