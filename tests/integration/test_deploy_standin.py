"""A local stand-in for the Kubernetes deployment: the router plus self-registering workers.

`pdserve up --prefill 2 --decode 2` plays the Deployments; more workers started with `--router`
play pods the HPA adds (they must start receiving traffic), and SIGTERM plays a pod's preStop
drain (the worker must leave rotation without failing a request, deregister and exit 0).
Every worker presents the registration secret, as the pods do.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
from fixtures.cluster import Cluster, start_cluster

httpx = pytest.importorskip("httpx")

SECRET = "stand-in-registration-secret"
WORKER_ARGS = ("--num-pages=256", "--max-running=16", f"--registration-secret={SECRET}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Worker:
    role: str
    proc: subprocess.Popen
    address: str = ""
    lines: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _start_worker(role: str, model: str, router_grpc: str, timeout_s: float = 120.0) -> Worker:
    """Like a pod the HPA adds: it knows only the router's address and the secret."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", role, "--model", model, "--router", router_grpc,
         *WORKER_ARGS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    w = Worker(role, proc)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        w.lines.append(line)
        if line.startswith("worker ready"):
            w.address = dict(kv.split("=", 1) for kv in line.split()[2:])["grpc"]
            threading.Thread(target=lambda: w.lines.extend(proc.stdout), daemon=True).start()
            return w
    w.stop()
    raise RuntimeError(f"{role} worker not ready:\n" + "".join(w.lines[-30:]))


def _wait_state(cluster: Cluster, address: str, present: bool, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        healthy = {w["address"] for w in cluster.workers() if w["state"] == "healthy"}
        listed = {w["address"] for w in cluster.workers()}
        if (address in healthy) if present else (address not in listed):
            return
        time.sleep(0.2)
    raise AssertionError(f"{address} present={not present} after {timeout_s}s: "
                         f"{cluster.workers()}")


def _complete(client: httpx.Client, model: str, i: int, max_tokens: int = 4
              ) -> tuple[str, str]:
    resp = client.post("/v1/completions", json={
        "model": model, "prompt": f"request {i}: the quick brown fox", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == max_tokens
    served = body["pdserve"]["choices"][0]
    return served["prefill_worker"], served["decode_worker"]


@pytest.fixture
def stand_in(tiny_model_dir):
    grpc_port = _free_port()
    cluster = start_cluster(tiny_model_dir, prefill=2, decode=2, worker_args=WORKER_ARGS,
                            router_args=(f"--grpc-port={grpc_port}",
                                         f"--registration-secret={SECRET}"))
    extra: list[Worker] = []
    try:
        yield cluster, f"127.0.0.1:{grpc_port}", extra
    finally:
        for w in extra:
            w.stop()
        assert cluster.stop() == 0, "".join(cluster.log[-30:])


def test_late_workers_get_traffic_and_a_drained_one_fails_no_request(stand_in, tiny_model_dir):
    cluster, router_grpc, extra = stand_in
    roles = sorted(w["role"] for w in cluster.workers())
    assert roles == ["decode", "decode", "prefill", "prefill"]
    client = httpx.Client(base_url=cluster.url, timeout=60)
    model = cluster.get("/v1/models")["data"][0]["id"]
    assert model

    # Scale out: one prefill and one decode pod more, registered through the router only.
    for role in ("prefill", "decode"):
        extra.append(_start_worker(role, tiny_model_dir, router_grpc))
    for w in extra:
        _wait_state(cluster, w.address, present=True)
    served = [_complete(client, model, i) for i in range(12)]
    assert extra[0].address in {p for p, _ in served}, served
    assert extra[1].address in {d for _, d in served}, served

    # Scale in: drain the late decode worker under steady load from 3 clients.
    errors: list[str] = []
    done = threading.Event()
    after_drain: list[tuple[str, str]] = []
    drained_at = [float("inf")]

    def load(k: int) -> None:
        with httpx.Client(base_url=cluster.url, timeout=60) as c:
            i = 0
            while not done.is_set():
                try:
                    started = time.monotonic()
                    pair = _complete(c, model, 1000 * k + i, max_tokens=16)
                    if started > drained_at[0]:
                        after_drain.append(pair)
                except AssertionError as e:  # a failed request is the failure under test
                    errors.append(str(e))
                i += 1

    threads = [threading.Thread(target=load, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        victim = extra[1]
        victim.proc.send_signal(signal.SIGTERM)
        assert victim.proc.wait(60) == 0, "".join(victim.lines[-30:])
        _wait_state(cluster, victim.address, present=False)
        drained_at[0] = time.monotonic()
        time.sleep(2.0)
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]
    assert after_drain and all(d != victim.address for _, d in after_drain)
    assert any("ready" in line for line in victim.lines)
    client.close()
