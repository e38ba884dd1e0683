"""The serving set-ups a goodput comparison runs, and `pdserve up` for one of them.

A set-up is written `KIND[:ARG][+slo][@R1/R2/...]`:
- `spatial[:SHARE]`: 1 prefill + 1 decode on one GPU as CUDA MPS clients (`--spatial`; no
  SM cap on either, or prefill on SHARE of the SMs and decode on the rest); `spatial:P/D` caps
  them at P and D (they may overlap, e.g. `spatial:0.6/1.0`: prefill on at most 60% of the
  SMs, decode on any);
- `timesliced`: the same two workers without MPS (`--no-spatial`: the GPU time-slices their
  contexts);
- `mixed[:CHUNK]`: one colocated worker, chunked prefill of CHUNK tokens (default 2048);
- `+slo`: the router's SLO dispatch on (`--slo-ttft-ms`, `--slo-itl-ms` from the SLOs);
- `@R1/R2/...`: the request rates to sweep (default: per kind, below).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from pdserve.bench.up_ready import exited_before_ready

KINDS = ("spatial", "timesliced", "mixed")
DEFAULT_RATES: dict[str, tuple[float, ...]] = {
    "spatial": (2, 4, 6, 8, 10, 12, 15),
    "timesliced": (1, 2, 4, 6, 8, 10),
    "mixed": (1, 2, 4, 6, 8, 10, 12),
}


def spatial_flags(split: str) -> list[str]:
    """`pdserve up` flags of an SM split `P/D` ("" -> none: its defaults)."""
    if not split:
        return []
    from pdserve.worker.sm_share import check_share

    parts = split.split("/")
    if len(parts) != 2:
        raise ValueError(f"expected P/D, e.g. 0.5/1.0, got {split!r}")
    try:
        prefill, decode = (float(x) for x in parts)
    except ValueError:
        raise ValueError(f"expected P/D as two numbers, e.g. 0.5/1.0, got {split!r}") from None
    check_share("prefill share", prefill)
    check_share("decode share", decode)
    return [f"--prefill-sm-share={prefill}", f"--decode-sm-share={decode}"]


@dataclass(frozen=True)
class Setup:
    name: str
    kind: str
    arg: str
    slo_dispatch: bool
    rates: tuple[float, ...]

    @property
    def dir_name(self) -> str:
        """The set-up's folder under the run's output, e.g. spatial-0.6-1.0."""
        return self.name.replace(":", "-").replace("+", "-").replace("/", "-")

    def up_args(self, slo_ttft_ms: float, slo_itl_ms: float) -> list[str]:
        """`pdserve up` flags of this set-up (besides model, device and port)."""
        if self.kind == "mixed":
            args = ["--prefill", "0", "--decode", "0", "--mixed", "1",
                    f"--worker-arg=--chunked-prefill-size={self.arg or 2048}"]
        else:
            args = ["--prefill", "1", "--decode", "1"]
        if self.kind == "spatial" and "/" in self.arg:
            args += ["--spatial", *spatial_flags(self.arg)]
        elif self.kind == "spatial":
            args += ["--spatial"] + (["--prefill-sm-share", self.arg] if self.arg else [])
        elif self.kind == "timesliced":
            args += ["--no-spatial"]
        if self.slo_dispatch:
            args += [f"--router-arg=--slo-ttft-ms={slo_ttft_ms:g}",
                     f"--router-arg=--slo-itl-ms={slo_itl_ms:g}"]
        return args


def parse_setup(spec: str) -> Setup:
    text, _, rates_s = spec.strip().partition("@")
    text, plus, extra = text.partition("+")
    if plus and extra != "slo":
        raise ValueError(f"setups: unknown option +{extra} in {spec!r} (only +slo)")
    kind, _, arg = text.partition(":")
    if kind not in KINDS:
        raise ValueError(f"setups: unknown kind {kind!r} in {spec!r} (choose from {KINDS})")
    if kind == "spatial" and "/" in arg:
        try:
            spatial_flags(arg)
        except ValueError as e:
            raise ValueError(f"setups: {spec!r}: {e}") from None
    elif arg:
        try:
            value = float(arg)
        except ValueError:
            raise ValueError(f"setups: {kind}:{arg} is not a number") from None
        if kind == "spatial" and not 0 < value < 1:
            raise ValueError(f"setups: a spatial share must be in (0, 1), got {arg}")
        if kind == "mixed" and (value < 1 or value != int(value)):
            raise ValueError(f"setups: a chunk size must be a positive integer, got {arg}")
        if kind == "timesliced":
            raise ValueError("setups: timesliced takes no argument")
    try:
        rates = tuple(float(r) for r in rates_s.split("/")) if rates_s else DEFAULT_RATES[kind]
    except ValueError:
        raise ValueError(f"setups: rates must be R1/R2/..., got {rates_s!r}") from None
    return Setup(name=spec.strip().partition("@")[0], kind=kind, arg=arg,
                 slo_dispatch=bool(plus), rates=rates)


@dataclass
class RunningCluster:
    """`pdserve up` in its own process group, its output copied to a log file."""

    popen: subprocess.Popen
    log_path: str
    ready_line: str = ""
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return self.ready_line.split()[2]

    @property
    def fields(self) -> dict[str, str]:
        return dict(kv.split("=", 1) for kv in self.ready_line.split()[3:] if "=" in kv)

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log_path, "a", encoding="utf-8") as log:
            for line in self.popen.stdout:
                log.write(line)
                log.flush()
                self.lines.append(line)
                if line.startswith("pdserve ready") and not self.ready.is_set():
                    self.ready_line = line.strip()
                    self.ready.set()
        self.ready.set()  # exited: wake the waiter

    def wait_ready(self, timeout_s: float) -> None:
        if not self.ready.wait(timeout_s):
            raise RuntimeError(f"pdserve up not ready in {timeout_s:.0f} s (log: {self.log_path})")
        if not self.ready_line:
            raise exited_before_ready("pdserve up", self.popen.wait(), self.lines)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            return self.popen.wait()


def start_cluster(argv: list[str], log_path: str) -> RunningCluster:
    """`python -m pdserve up ARGV`; wait_ready() before use, stop() always. It runs in the
    log's directory: a checkout's bare pdserve/ folder in the working directory would shadow
    the package where it is reached through PYTHONPATH (scripts/gpu-check)."""
    directory = os.path.dirname(os.path.abspath(log_path))
    os.makedirs(directory, exist_ok=True)
    popen = subprocess.Popen([sys.executable, "-m", "pdserve", "up", *argv],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, cwd=directory)
    cluster = RunningCluster(popen, log_path)
    threading.Thread(target=cluster._pump, daemon=True).start()
    return cluster
