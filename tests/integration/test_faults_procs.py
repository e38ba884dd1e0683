"""Router and workers as separate processes, for fault tests (no tests here; imported by others).

Unlike `pdserve up`, each process can be stopped, killed or restarted on its own. Every process
runs in its own session; `ProcCluster.close()` (called by the `procs` fixture in a finally)
stops whatever is left (SIGKILL past a few seconds), so a failing test never leaves processes
or shared memory behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field

import pytest

# Short deadlines so faults resolve in seconds (the defaults are documented in
# docs/reliability.md). A KV peer silent for 0.5 s x 4 fails its rooms.
FAST_WORKER_ARGS = ("--bootstrap-timeout=5", "--waiting-timeout=10", "--transfer-timeout=10",
                    "--heartbeat-interval=0.5", "--heartbeat-misses=4", "--drain-timeout=30",
                    "--max-running=64")
FAST_ROUTER_ARGS = ("--health-check-interval=0.5", "--heartbeat-interval=0.5", "--lease=4")
READY_TIMEOUT_S = 240.0  # a loaded 2-core machine imports torch slowly


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    fields: dict[str, str] = field(default_factory=dict)
    log: deque = field(default_factory=lambda: deque(maxlen=200))

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def wait(self, timeout_s: float) -> int:
        return self.popen.wait(timeout_s)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        return "".join(list(self.log)[-n:])


class ProcCluster:
    def __init__(self, model: str) -> None:
        self.model = model
        self.procs: list[Proc] = []
        self.router: Proc | None = None

    # ---- processes -------------------------------------------------------------------------
    def _launch(self, name: str, argv: list[str]) -> Proc:
        popen = subprocess.Popen([sys.executable, "-m", "pdserve", *argv],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        proc = Proc(name, popen)
        self.procs.append(proc)
        return proc

    def _await_ready(self, proc: Proc, prefix: str) -> Proc:
        popen = proc.popen
        deadline = time.monotonic() + READY_TIMEOUT_S
        assert popen.stdout is not None
        while time.monotonic() < deadline:
            line = popen.stdout.readline()
            if not line:
                raise RuntimeError(f"{proc.name} exited before ready:\n{proc.tail()}")
            proc.log.append(line)
            if line.startswith(f"{prefix} ready"):
                proc.fields = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
                threading.Thread(target=lambda: [proc.log.append(x) for x in popen.stdout],
                                 daemon=True).start()
                return proc
        raise RuntimeError(f"{proc.name}: not ready in time:\n{proc.tail()}")

    def start_router(self, *args: str, grpc_port: int = 0) -> Proc:
        self.router = self._await_ready(self._launch("router", [
            "router", "--model", self.model, "--port", "0", "--grpc-port", str(grpc_port),
            "--log-level", "warning", *FAST_ROUTER_ARGS, *args]), "router")
        return self.router

    def start_workers(self, *roles: str, args: tuple[str, ...] = ()) -> list[Proc]:
        """Start workers (in parallel) that register with the router; wait for them all."""
        assert self.router is not None
        started = []
        for role in roles:
            n = sum(1 for p in self.procs if p.name.startswith(role))
            started.append(self._launch(f"{role}-{n}", [
                role, "--model", self.model, "--router", self.grpc_addr, *FAST_WORKER_ARGS,
                *args]))
        return [self._await_ready(p, "worker") for p in started]

    def start_worker(self, role: str, *args: str) -> Proc:
        return self.start_workers(role, args=args)[0]

    def close(self) -> None:
        """Stop at once (two SIGTERMs: no drain, but pools unlinked and ports closed by the
        processes themselves), then SIGKILL whatever is left."""
        for sig in (signal.SIGCONT, signal.SIGTERM):  # a stopped process must continue first
            for p in self.procs:
                p.signal(sig)
        time.sleep(0.3)
        for p in self.procs:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while any(p.alive for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in self.procs:
            p.signal(signal.SIGKILL)
        for p in self.procs:
            try:
                p.popen.wait(30)
            except subprocess.TimeoutExpired:
                pass

    # ---- router views ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.fields["http"]

    @property
    def grpc_addr(self) -> str:
        assert self.router is not None
        return self.router.fields["grpc"]

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as resp:
            return json.load(resp)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as resp:
            return resp.read().decode()

    def workers(self) -> list[dict]:
        return self.get("/workers")["workers"]

    def wait_workers(self, pred, timeout_s: float = 60.0) -> list[dict]:
        """Poll /workers until `pred(workers)` holds; fail the test with the last view."""
        deadline = time.monotonic() + timeout_s
        workers: list[dict] = []
        while time.monotonic() < deadline:
            try:
                workers = self.workers()
                if pred(workers):
                    return workers
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        pytest.fail(f"workers never reached the expected state: {workers}\n" + self.logs())

    def wait_healthy(self, count: int, timeout_s: float = 60.0) -> list[dict]:
        return self.wait_workers(
            lambda ws: sum(w["state"] == "healthy" for w in ws) >= count, timeout_s)

    def wait_idle(self, timeout_s: float = 60.0) -> list[dict]:
        """Every registered worker: no request, no page in use (reported by heartbeats)."""
        return self.wait_workers(lambda ws: all(
            w["kv_pages_in_use"] == 0 and w["num_running"] == 0 and w["num_waiting"] == 0
            and w["num_inflight"] == 0 for w in ws), timeout_s)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail()}" for p in self.procs)


@pytest.fixture
def procs(tiny_model_dir):
    cluster = ProcCluster(tiny_model_dir)
    try:
        yield cluster
    finally:
        cluster.close()


def post(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, dict]:
    """POST JSON; (status, parsed body) for 2xx and errors alike."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
