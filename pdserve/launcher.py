"""`pdserve up`: a router plus N prefill and M decode workers as processes on this machine.

Prints one line containing `ready` and the URL once every worker has registered with the
router. SIGINT, SIGTERM and SIGHUP drain: the workers finish their requests and deregister, then
the router stops; a second signal makes them stop at once. Whatever ends the launcher, SIGKILL
included, its processes stop with it (pdserve/child.py). A worker that exits leaves rotation and
the others keep serving; a router that exits is started again on the same ports after a backoff
(RESTART_BACKOFF_S, doubling), and the workers, which stay up, register with the new one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request

from pdserve.child import Child, Lifeline
from pdserve.engine.model_shapes import add_model_source_args
from pdserve.worker.sm_share import check_share, percentage

# The SM shares under MPS when none is given: no cap on either side (docs/performance.md,
# "Spatial P/D on one GPU", says what each split measured).
DEFAULT_SM_SHARE = 1.0
RESTART_BACKOFF_S = (1.0, 30.0)  # first delay before a router restart, and the cap
RESTART_RESET_S = 60.0  # a router up this long restarts after the first delay again


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    add_model_source_args(p)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--mixed", type=int, default=0, help="colocated workers (no transfer)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when a GPU is there, else cpu), cpu or cuda (GPUs assigned "
                        "round-robin)")
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
    p.add_argument("--spatial", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA: prefill and decode workers that share a GPU run side by side as "
                        "CUDA MPS clients, each capped at its share of the SMs (MPS started as "
                        "needed; pdserve/spatial.py). Default: on where they share a GPU and "
                        "MPS works; --no-spatial: the GPU time-slices them")
    p.add_argument("--prefill-sm-share", type=float, default=None, metavar="F",
                   help=f"spatial: share of the SMs for prefill workers (default "
                        f"{DEFAULT_SM_SHARE:g}: no cap)")
    p.add_argument("--decode-sm-share", type=float, default=None, metavar="F",
                   help="spatial: share for decode workers (default: the rest of "
                        "--prefill-sm-share when that is given, else no cap)")
    return p


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _log(msg: str) -> None:
    print(f"pdserve up: {msg}", file=sys.stderr, flush=True)


def _stop_all(procs: list[Child], timeout_s: float = 30.0) -> None:
    """Workers drain first (SIGTERM, deregister), then the router; SIGKILL past the timeout."""
    workers = [p for p in procs if p.prefix != "router"]
    routers = [p for p in procs if p.prefix == "router"]
    for group in (workers, routers):
        for p in group:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in group:
            while p.running and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.running:
                p.kill()
            p.popen.wait()


class _Router:
    """The router child and its restarts: same ports, backoff doubling, reset after uptime."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], lifeline: Lifeline,
                 procs: list[Child]) -> None:
        self.args, self.env, self.lifeline, self.procs = args, env, lifeline, procs
        self.child = self._spawn(args.port, args.grpc_port)
        self.http = self.grpc = ""
        self.delay = RESTART_BACKOFF_S[0]

    def _spawn(self, http_port: int, grpc_port: int) -> Child:
        a = self.args
        child = Child.spawn("router", "router", [
            "router", "--host", a.host, "--port", str(http_port), "--grpc-port",
            str(grpc_port), *a.source, *a.router_arg], self.env, self.lifeline)
        self.procs.append(child)
        return child

    def wait_ready(self, deadline: float, stop: threading.Event) -> None:
        ready = self.child.wait_ready(deadline, stop)
        self.http, self.grpc = ready["http"], ready["grpc"]

    def restart(self, stop: threading.Event) -> None:
        """The router exited: start it again after the backoff (unless `stop` comes first)."""
        old = self.child
        uptime = time.monotonic() - old.started_at
        if uptime >= RESTART_RESET_S:
            self.delay = RESTART_BACKOFF_S[0]
        _log(f"the router exited with {old.popen.returncode} after {uptime:.0f}s; restarting "
             f"it in {self.delay:.0f}s (workers stay up)")
        self.procs.remove(old)
        if stop.wait(self.delay):
            return
        self.delay = min(self.delay * 2, RESTART_BACKOFF_S[1])
        http_port = int(self.http.rpartition(":")[2])
        grpc_port = int(self.grpc.rpartition(":")[2])
        self.child = self._spawn(http_port, grpc_port)
        try:
            self.wait_ready(time.monotonic() + self.args.ready_timeout, stop)
        except RuntimeError as e:
            if stop.is_set():
                return  # stopping: _stop_all takes it down with the others
            _log(f"router restart failed: {e}")
            if self.child.running:
                self.child.kill()
            return  # the supervisor sees it exited and tries again after a longer delay
        _log(f"the router is back at {self.http}; workers register with it again")


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
        resolve_shares(args)
    except ValueError as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return 2
    if args.model is not None and args.model_shape is not None:
        print("pdserve up: error: model_shape: give either --model or --model-shape",
              file=sys.stderr)
        return 2
    # Fetch (or export) once here, not in every process at once.
    if args.model_shape is not None:
        from pdserve.engine.default_model import default_tokenizer_path

        default_tokenizer_path()
    elif args.model is None:
        from pdserve.engine.default_model import default_model_path

        args.model = default_model_path()
    args.source = (["--model", args.model] if args.model is not None else
                   ["--model-shape", args.model_shape]) + ["--load-format", args.load_format]
    env = dict(os.environ)
    lifeline = Lifeline()
    procs: list[Child] = []
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stop.is_set():  # a second signal: the children stop at once instead of draining
            for p in procs:
                p.signal(signal.SIGTERM)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    deadline = time.monotonic() + args.ready_timeout
    spatial = None
    try:
        router = _Router(args, env, lifeline, procs)
        # While the router starts: the device, each worker's GPUs, and the MPS set-up.
        gpus = _gpu_count() if args.device.startswith(("cuda", "auto")) else 0
        if args.device == "auto":
            args.device = "cuda" if gpus else "cpu"
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode + ["mixed"] * args.mixed
        if gpus and max(tps[r] for r in roles) > gpus:
            raise RuntimeError(f"--tp: {max(tps[r] for r in roles)} ranks per worker, "
                               f"{gpus} GPUs visible")
        placed = assign_gpus(roles, tps, gpus)
        shared = shares_a_gpu(roles, placed)
        tried = args.spatial or (args.spatial is None and shared)
        if tried:
            spatial = _plan_spatial(args, env, gpus, shared)
        if spatial is not None:
            spatial.daemon.guard(lifeline.read_fd)  # quits it if this process dies unstopped
        router.wait_ready(deadline, stop)
        # CPU workers share the cores: oversubscribed torch threads slow every matmul badly.
        threads = [] if gpus else ["--threads", str(max(1, (os.cpu_count() or 1) // len(roles)))]
        workers = []
        for i, role in enumerate(roles):
            wenv = dict(env)
            tp = tps[role]
            if placed[i]:
                wenv["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, placed[i]))
            share = spatial.worker_args(role) if spatial is not None else []
            workers.append(Child.spawn(
                f"{role}-{i}", "worker",
                [role, *args.source, "--device", args.device, "--host", args.host,
                 "--router", router.grpc, "--tp", str(tp), *threads, *share, *args.worker_arg],
                wenv, lifeline))
            procs.append(workers[-1])
        for proc in workers:
            proc.wait_ready(deadline, stop)
        _wait_registered(router.http, len(roles), deadline, stop)
        tail = ""
        if tried:  # what the SMs are split into, or `off` (the plain path was taken)
            tail = " spatial=" + ("off" if spatial is None else "/".join(
                str(percentage(spatial.shares[r])) for r in ("prefill", "decode")))
        print(f"pdserve ready {router.http} grpc={router.grpc} prefill={args.prefill} "
              f"decode={args.decode} mixed={args.mixed}{tail}", flush=True)
        _supervise(router, procs, stop)
        return 0
    except RuntimeError as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return 1
    finally:
        _stop_all(procs)
        if spatial is not None:
            spatial.close()


def resolve_shares(args: argparse.Namespace) -> None:
    """Fill in the SM shares left unset: decode takes the rest of a given prefill share, and
    neither is capped when neither is given."""
    if args.decode_sm_share is None:
        args.decode_sm_share = DEFAULT_SM_SHARE if args.prefill_sm_share is None else \
            max(0.01, round(1.0 - args.prefill_sm_share, 4))
    if args.prefill_sm_share is None:
        args.prefill_sm_share = DEFAULT_SM_SHARE
    check_share("prefill_sm_share", args.prefill_sm_share)
    check_share("decode_sm_share", args.decode_sm_share)


def assign_gpus(roles: list[str], tps: dict[str, int], gpus: int) -> list[tuple[int, ...]]:
    """Each worker's GPUs: its ranks take consecutive GPUs, round-robin over what is visible
    (none on the CPU)."""
    out, first = [], 0
    for role in roles:
        n = tps[role] if gpus else 0
        out.append(tuple((first + r) % gpus for r in range(n)))
        first += n
    return out


def shares_a_gpu(roles: list[str], placed: list[tuple[int, ...]]) -> bool:
    """Whether a prefill worker and a decode worker have a GPU in common."""
    on = {role: {g for r, gs in zip(roles, placed) if r == role for g in gs}
          for role in ("prefill", "decode")}
    return bool(on["prefill"] & on["decode"])


def _plan_spatial(args: argparse.Namespace, env: dict[str, str], gpus: int,  # noqa: ANN202
                  shared: bool):
    """The MPS set-up (its client environment added to `env`), or None and a message saying
    why prefill and decode workers sharing a GPU are time-sliced on it instead."""
    from pdserve.spatial import plan_spatial

    if args.prefill == 0:
        plan, message = None, "needs prefill and decode workers (there are none to split)"
    elif not shared and args.device.startswith("cuda"):
        _log("spatial: no prefill worker shares a GPU with a decode worker: nothing to split")
        return None
    else:
        plan, message = plan_spatial(args.device, gpus, args.prefill_sm_share,
                                     args.decode_sm_share)
    if plan is None:
        print(f"pdserve up: spatial: {message}; prefill and decode share the GPU "
              f"time-sliced (the plain path)", file=sys.stderr,
              flush=True)
        return None
    env.update(plan.daemon.env)
    print(f"pdserve up: spatial: {message}", file=sys.stderr, flush=True)
    return plan


def _supervise(router: _Router, procs: list[Child], stop: threading.Event) -> None:
    """Until a stop signal: drop workers that exited, restart a router that did."""
    while not stop.is_set():
        for p in [p for p in procs if p.prefix == "worker" and not p.running]:
            if p.popen.returncode != 0:
                _log(f"{p.name} exited with {p.popen.returncode}; serving with the remaining "
                     f"workers")
            procs.remove(p)
        if not router.child.running:
            router.restart(stop)
            continue
        stop.wait(0.5)


def _wait_registered(http: str, count: int, deadline: float, stop: threading.Event) -> None:
    while time.monotonic() < deadline and not stop.is_set():
        try:
            with urllib.request.urlopen(f"{http}/workers", timeout=5) as resp:
                workers = json.load(resp)["workers"]
            if sum(1 for w in workers if w.get("state") == "healthy") >= count:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"workers did not all register with the router at {http}")
