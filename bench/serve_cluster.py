"""The processes of `scripts/serve-bench`: the offline engine's run, and per topology a
`pdserve up` cluster driven by `pdserve bench` (with the router's and workers' CPU use sampled
from /proc over each workload), then stopped."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

from pdserve.bench.serve_compare import Workload, bench_args, workload_seed
from pdserve.bench.up_ready import exited_before_ready, tail

# name: (prefill, decode, mixed workers, extra `pdserve up` flags). pd: the 1P1D pair as
# `pdserve up` runs it (on one GPU: MPS clients with no SM cap, where MPS works;
# pdserve/spatial.py); pd-timesliced: the pair without MPS; pd-spatial: MPS clients on the
# shares of --sm-split (where MPS is missing `pdserve up` says why and runs them time-sliced).
TOPOLOGIES = {"mixed": ("0", "0", "1", ()), "pd": ("1", "1", "0", ()),
              "pd-timesliced": ("1", "1", "0", ("--no-spatial",)),
              "pd-spatial": ("1", "1", "0", ("--spatial",))}
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _run(cmd: list[str], log: str, timeout_s: float) -> subprocess.CompletedProcess:
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True,
                              timeout=timeout_s, check=False)
    with open(log, "a", encoding="utf-8") as f:
        f.write(proc.stdout)
    if proc.returncode not in (0, 1):  # pdserve bench exits 1 when some requests failed
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {proc.returncode}; see {log}")
    return proc


def run_offline(args: argparse.Namespace, report: dict) -> dict:
    t0 = time.perf_counter()
    out = os.path.join(args.out, "offline.json")
    cmd = [sys.executable, "-m", "pdserve.bench.serve_offline", "--device", args.device,
           "--model-shape", args.model_shape, "--num-pages", str(args.num_pages),
           "--seed", str(args.seed), *(["--quick"] if args.quick else []),
           *(["--workloads", args.workloads] if args.workloads else []), "--out", out]
    _run(cmd, os.path.join(args.out, "offline.log"), 900)
    report["phases_s"]["offline"] = time.perf_counter() - t0
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def _children(pid: int) -> dict[str, int]:
    """{role: pid} of the processes `pdserve up` (pid) started."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"pdserve" in argv:
            role = argv[argv.index(b"pdserve") + 1].decode()
            out[role if role not in out else f"{role}2"] = int(entry)
    return out


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (a load generator, once it exited)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK
    except (OSError, ValueError, IndexError):
        return 0.0


class Cluster:
    def __init__(self, args: argparse.Namespace, topo: str) -> None:
        prefill, decode, mixed, extra = TOPOLOGIES[topo]
        if "--spatial" in extra:
            extra = (*extra, *getattr(args, "spatial_flags", ()))
        cmd = [sys.executable, "-m", "pdserve", "up", "--model-shape", args.model_shape,
               "--device", args.device, "--port", "0", "--prefill", prefill, "--decode", decode,
               "--mixed", mixed, *extra, "--worker-arg=--max-running=256",
               f"--worker-arg=--num-pages={args.num_pages}",
               *(f"--router-arg={flag}" for flag in getattr(args, "router_arg", ()))]
        self.log = open(os.path.join(args.out, f"cluster-{topo}.log"), "w", encoding="utf-8")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.url = self.spatial = ""
        last = tail()
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            last.append(line)
            if line.startswith("pdserve ready"):
                self.url = line.split()[2]
                # e.g. spatial=50/50 or spatial=off: what the cluster really ran as
                self.spatial = next((f.split("=", 1)[1] for f in line.split()
                                     if f.startswith("spatial=")), "")
                break
        if not self.url:
            self.log.close()
            raise exited_before_ready(f"pdserve up ({topo})", self.proc.wait(), last)
        self.ready_s = time.perf_counter() - t0
        self.log.flush()
        threading.Thread(target=self._drain, daemon=True).start()
        self.pids = _children(self.proc.pid)

    def _drain(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.log.write(line)

    def cpu(self) -> dict[str, float]:
        return {role: _cpu_s(pid) for role, pid in self.pids.items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def _summary(bench: dict, cpu0: dict[str, float], cpu1: dict[str, float]) -> dict:
    dur = max(bench["duration_s"], 1e-9)
    out = {"output_tok_s": bench["output_throughput"], "completed": bench["completed"],
           "failed": bench["failed"], "ttft_p50_ms": bench["ttft_ms"]["p50"],
           "itl_p50_ms": bench["itl_ms"]["p50"], "tpot_mean_ms": bench["tpot_ms"]["mean"],
           "duration_s": bench["duration_s"], "errors": bench["errors"]}
    stages = bench.get("stages", {})
    if stages.get("source") == "responses":  # the router's per-stage times, p50 over requests
        out["stages_p50_ms"] = {s: round(v["p50"], 2) for s, v in stages["stages_ms"].items()
                                if s not in stages.get("not_reported", ())}
    # % of one core over the run (the warm-up requests included, a few percent of it).
    out["cpu_pct"] = {r: round(100 * (cpu1[r] - cpu0.get(r, 0.0)) / dur, 1) for r in cpu1}
    return out


def run_served(args: argparse.Namespace, loads: tuple[Workload, ...], topo: str,
               report: dict) -> dict:
    from pdserve.bench.serve_check import independent_check
    from pdserve.bench.serve_profile import Recorders
    from pdserve.engine.default_model import default_tokenizer_path

    t0 = time.perf_counter()
    tok = default_tokenizer_path()
    cluster = Cluster(args, topo)
    result: dict = {"ready_s": cluster.ready_s, "spatial": cluster.spatial}
    try:
        for i, w in enumerate(loads):
            seed = workload_seed(args.seed, i)
            if time.perf_counter() > args.deadline:
                result[w.name] = {"skipped": "out of the time budget"}
                continue
            cpu0 = cluster.cpu()
            cmd = [sys.executable, "-m", "pdserve", "bench", "--base-url", cluster.url,
                   *bench_args(w, seed, tok), "--json", "--no-progress"]
            client0 = _children_cpu_s()
            spy = (Recorders(cluster.pids, os.path.join(args.out, "pyspy"), f"{topo}-{w.name}")
                   if args.py_spy else None)
            t_start = time.time()
            try:
                proc = _run(cmd, os.path.join(args.out, f"bench-{topo}-{w.name}.log"), 900)
            finally:
                profile = spy.stop() if spy is not None else None
            bench = json.loads(proc.stdout.strip().splitlines()[-1])
            result[w.name] = _summary(bench, cpu0, cluster.cpu())
            result[w.name].update(t_start=t_start, t_end=time.time())  # for the step traces
            # Its start-up (imports, the tokenizer) included: a bound, not a rate.
            result[w.name]["client_cpu_s"] = round(_children_cpu_s() - client0, 2)
            print(f"{topo} {w.name}: {json.dumps(result[w.name])}", flush=True)
            if profile is not None:
                report.setdefault("py_spy", {})[f"{topo}-{w.name}"] = profile
            if topo == "mixed" and w.name == "b" and not args.no_check:
                # Prompts of another seed (same shape and prefix sharing): the bench's own
                # would all hit the radix cache it just filled.
                report["check"] = independent_check(cluster.url, w, seed + 1, args.out)
                report["check"]["bench_tok_s"] = result[w.name]["output_tok_s"]
                print(f"check: {json.dumps(report['check'])}", flush=True)
    finally:
        cluster.stop()
    report["phases_s"][topo] = time.perf_counter() - t0
    return result
