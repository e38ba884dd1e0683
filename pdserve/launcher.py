"""`pdserve up`: a router plus N prefill and M decode workers as processes on this machine.

Prints one line containing `ready` and the URL once every worker has registered with the
router; Ctrl-C / SIGTERM drains the workers, stops the router, and leaves no process behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

from pdserve.worker.sm_share import check_share, percentage

# Prefill's share of the SMs under --spatial (docs/performance.md, "Spatial P/D").
DEFAULT_PREFILL_SM_SHARE = 0.5


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready: dict[str, str]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--mixed", type=int, default=0, help="colocated workers (no transfer)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (GPUs assigned round-robin)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per worker (each worker gets that many GPUs)")
    for role in ("prefill", "decode", "mixed"):
        p.add_argument(f"--{role}-tp", type=int, default=None,
                       help=f"tensor-parallel ranks per {role} worker (default: --tp)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the router (0 = free)")
    p.add_argument("--grpc-port", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag")
    p.add_argument("--spatial", action="store_true",
                   help="CUDA: prefill and decode workers on separate shares of a GPU's SMs "
                        "(CUDA MPS, started as needed; pdserve/spatial.py)")
    p.add_argument("--prefill-sm-share", type=float, default=DEFAULT_PREFILL_SM_SHARE,
                   metavar="F", help="--spatial: share of the SMs for prefill workers")
    p.add_argument("--decode-sm-share", type=float, default=None, metavar="F",
                   help="--spatial: share for decode workers (default: the rest)")
    return p


def _spawn(name: str, argv: list[str], env: dict[str, str]) -> Proc:
    popen = subprocess.Popen([sys.executable, "-m", "pdserve", *argv], stdout=subprocess.PIPE,
                             text=True, env=env, start_new_session=True)
    return Proc(name, popen, {})


def _await_ready(proc: Proc, prefix: str, deadline: float) -> dict[str, str]:
    """Read stdout until the `<prefix> ready k=v ...` line; then echo the rest in a thread."""
    assert proc.popen.stdout is not None
    while time.monotonic() < deadline:
        line = proc.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.wait()} before ready")
        if line.startswith(f"{prefix} ready"):
            fields = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
            threading.Thread(target=_echo, args=(proc,), daemon=True).start()
            return fields
        sys.stdout.write(line)
    raise RuntimeError(f"{proc.name}: not ready in time")


def _echo(proc: Proc) -> None:
    for line in proc.popen.stdout:  # type: ignore[union-attr]
        sys.stdout.write(f"[{proc.name}] {line}")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _stop_all(procs: list[Proc], timeout_s: float = 30.0) -> None:
    """Workers drain first (SIGTERM, deregister), then the router; SIGKILL past the timeout."""
    workers = [p for p in procs if p.name != "router"]
    routers = [p for p in procs if p.name == "router"]
    for group in (workers, routers):
        for p in group:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in group:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if min(args.prefill, args.decode, args.mixed) < 0 or args.prefill + args.decode + \
            args.mixed == 0:
        print("pdserve up: error: need at least one worker", file=sys.stderr)
        return 2
    if (args.prefill == 0) != (args.decode == 0):
        print("pdserve up: error: --prefill and --decode go together", file=sys.stderr)
        return 2
    tps = {role: getattr(args, f"{role}_tp") or args.tp for role in ("prefill", "decode", "mixed")}
    if min(tps.values()) < 1:
        print("pdserve up: error: --tp: must be at least 1", file=sys.stderr)
        return 2
    try:
        check_share("prefill_sm_share", args.prefill_sm_share)
        if args.decode_sm_share is None:
            args.decode_sm_share = max(0.01, round(1.0 - args.prefill_sm_share, 4))
        check_share("decode_sm_share", args.decode_sm_share)
    except ValueError as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return 2
    if args.model is None:
        from pdserve.engine.default_model import default_model_path

        args.model = default_model_path()  # fetch once here, not in every worker at once
    env = dict(os.environ)
    procs: list[Proc] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    deadline = time.monotonic() + args.ready_timeout
    spatial = None
    try:
        if args.spatial:
            spatial = _plan_spatial(args, env)
        router = _spawn("router", ["router", "--host", args.host, "--port", str(args.port),
                                   "--grpc-port", str(args.grpc_port), "--model", args.model,
                                   *args.router_arg], env)
        procs.append(router)
        ready = _await_ready(router, "router", deadline)
        grpc_addr, http = ready["grpc"], ready["http"]
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode + ["mixed"] * args.mixed
        gpus = _gpu_count() if args.device.startswith("cuda") else 0
        if gpus and max(tps[r] for r in roles) > gpus:
            raise RuntimeError(f"--tp: {max(tps[r] for r in roles)} ranks per worker, "
                               f"{gpus} GPUs visible")
        # CPU workers share the cores: oversubscribed torch threads slow every matmul badly.
        threads = [] if gpus else ["--threads", str(max(1, (os.cpu_count() or 1) // len(roles)))]
        first_gpu = 0
        for i, role in enumerate(roles):
            wenv = dict(env)
            tp = tps[role]
            if gpus:  # a worker's ranks take consecutive GPUs (one each: round-robin)
                wenv["CUDA_VISIBLE_DEVICES"] = ",".join(
                    str((first_gpu + r) % gpus) for r in range(tp))
                first_gpu += tp
            share = spatial.worker_args(role) if spatial is not None else []
            proc = _spawn(f"{role}-{i}", [role, "--model", args.model, "--device", args.device,
                                          "--host", args.host, "--router", grpc_addr,
                                          "--tp", str(tp), *threads, *share, *args.worker_arg],
                          wenv)
            procs.append(proc)
        for proc in procs[1:]:
            proc.ready = _await_ready(proc, "worker", deadline)
        _wait_registered(http, len(roles), deadline)
        tail = ""
        if args.spatial:  # what the SMs are split into, or `off` (the plain path was taken)
            tail = " spatial=" + ("off" if spatial is None else "/".join(
                str(percentage(spatial.shares[r])) for r in ("prefill", "decode")))
        print(f"pdserve ready {http} grpc={grpc_addr} prefill={args.prefill} "
              f"decode={args.decode} mixed={args.mixed}{tail}", flush=True)
        while not stop.is_set():
            # A worker that exits (drained, or died) leaves rotation and the others keep
            # serving; only the router's exit ends the cluster.
            for p in [p for p in procs if p.name != "router" and p.popen.poll() is not None]:
                if p.popen.returncode != 0:
                    print(f"pdserve up: {p.name} exited with {p.popen.returncode}; serving "
                          f"with the remaining workers", file=sys.stderr, flush=True)
                procs.remove(p)
            if router.popen.poll() is not None:
                print(f"pdserve up: the router exited with {router.popen.returncode}",
                      file=sys.stderr)
                return 1
            stop.wait(0.5)
        return 0
    except RuntimeError as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return 1
    finally:
        _stop_all(procs)
        if spatial is not None:
            spatial.close()


def _plan_spatial(args: argparse.Namespace, env: dict[str, str]):  # noqa: ANN202
    """The MPS set-up for --spatial (its client environment added to `env`), or None and a
    message saying why the workers share the GPU time-sliced instead."""
    from pdserve.spatial import plan_spatial

    gpus = _gpu_count() if args.device.startswith(("cuda", "auto")) else 0
    device = ("cuda" if gpus else "cpu") if args.device == "auto" else args.device
    if args.prefill == 0:
        plan, message = None, "needs prefill and decode workers (there are none to split)"
    else:
        plan, message = plan_spatial(device, gpus, args.prefill_sm_share, args.decode_sm_share)
    if plan is None:
        print(f"pdserve up: --spatial: {message}; prefill and decode share the GPU "
              f"time-sliced (the plain path)", file=sys.stderr, flush=True)
        return None
    env.update(plan.daemon.env)
    print(f"pdserve up: --spatial: {message}", file=sys.stderr, flush=True)
    return plan


def _wait_registered(http: str, count: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{http}/workers", timeout=5) as resp:
                workers = json.load(resp)["workers"]
            if sum(1 for w in workers if w.get("state") == "healthy") >= count:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"workers did not all register with the router at {http}")
