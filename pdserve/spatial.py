"""`pdserve up --spatial`: prefill and decode workers on disjoint shares of one GPU's SMs.

The two workers stay two processes, each a CUDA MPS client capped by `--sm-share`
(worker/sm_share.py), and KV still moves by CUDA IPC between them. This module runs the MPS
control daemon they need: one already serving `CUDA_MPS_PIPE_DIRECTORY` (or the driver's
default directory) is used as it is; otherwise one is started with its pipe and log
directories under a fresh temporary directory and quit (and the directory removed) when the
cluster stops. Before any worker starts, a probe process creates a CUDA context through it
and the daemon must then list an MPS server: a context that silently fell back to a plain
one would make the shares meaningless.

A daemon started here also quits when the launcher dies without stopping it (SIGKILL): a
small process started beside it watches the launcher's lifeline (`MpsDaemon.guard`).

Where that cannot work (no CUDA device, no `nvidia-cuda-mps-control` on PATH, a daemon that
does not start, a driver whose clients do not reach it) `pdserve up` prints why and runs the
plain path: the workers share the GPU time-sliced.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.worker.sm_share import LOG_ENV, PCT_ENV, PIPE_ENV, daemon_pid, percentage, pipe_dir

BINARY = "nvidia-cuda-mps-control"
# A CUDA context made the way a worker makes it (torch), held until stdin closes so the daemon
# is asked for its servers while the context is its client.
PROBE_READY = "mps-probe-ready"
PROBE = ("import sys, torch; x = torch.ones(1, device='cuda'); torch.cuda.synchronize(); "
         f"print({PROBE_READY!r}, flush=True); sys.stdin.read()")
READY_TIMEOUT_S = 10.0
REAP = "--reap"  # `python -m pdserve.spatial --reap ...`: MpsDaemon.guard's process
PROBE_TIMEOUT_S = 120.0  # a cold torch import plus CUDA initialisation


def control(binary: str, command: str, env: dict[str, str], timeout_s: float = 10.0) -> str:
    """One command to the daemon (its stdin protocol); its answer."""
    out = subprocess.run([binary], input=command + "\n", env=env, capture_output=True,
                         text=True, timeout=timeout_s, check=False)
    return out.stdout.strip()


@dataclass
class MpsDaemon:
    """An MPS control daemon: ours (`owned`: started here, quit in `stop`) or one that runs."""

    binary: str
    pipe_dir: str
    log_dir: str | None
    owned: bool
    tmp_dir: str | None = None
    server_pids: set[int] = field(default_factory=set)

    @property
    def env(self) -> dict[str, str]:
        """What a client needs to find this daemon."""
        out = {PIPE_ENV: self.pipe_dir}
        if self.log_dir:
            out[LOG_ENV] = self.log_dir
        return out

    def _full_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    @classmethod
    def running(cls, binary: str, env: dict[str, str] | None = None) -> MpsDaemon | None:
        directory = pipe_dir(dict(os.environ if env is None else env))
        if daemon_pid(directory) is None:
            return None
        return cls(binary, directory, (env or os.environ).get(LOG_ENV), owned=False)

    @classmethod
    def start(cls, binary: str) -> MpsDaemon:
        # Unix socket paths are short (108 bytes): keep the directory near the root.
        base = tempfile.gettempdir() if len(tempfile.gettempdir()) < 40 else "/tmp"
        tmp = tempfile.mkdtemp(prefix="pdserve-mps-", dir=base)
        daemon = cls(binary, os.path.join(tmp, "pipe"), os.path.join(tmp, "log"), owned=True,
                     tmp_dir=tmp)
        os.mkdir(daemon.pipe_dir)
        os.mkdir(daemon.log_dir or "")
        try:
            # Output to a file, not a pipe: the daemon it forks could hold a pipe open.
            out_path = os.path.join(tmp, "start.out")
            with open(out_path, "w+", encoding="utf-8") as out:
                run = subprocess.run([binary, "-d"], env=daemon._full_env(),
                                     stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, timeout=READY_TIMEOUT_S,
                                     check=False)
                out.seek(0)
                said = out.read().strip()[-300:]
            if run.returncode != 0:
                raise RuntimeError(f"`{binary} -d` exited with {run.returncode}: {said}")
            deadline = time.monotonic() + READY_TIMEOUT_S
            while daemon_pid(daemon.pipe_dir) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the MPS control daemon did not start{daemon.log_tail()}")
                time.sleep(0.05)
        except (OSError, subprocess.SubprocessError, RuntimeError):
            daemon.stop()
            raise
        return daemon

    def log_tail(self, n: int = 400) -> str:
        if not self.log_dir:
            return ""
        try:
            with open(os.path.join(self.log_dir, "control.log"), encoding="utf-8",
                      errors="replace") as f:
                return f" (control.log: ...{f.read()[-n:].strip()})"
        except OSError:
            return ""

    def servers(self) -> set[int]:
        """Pids of the MPS servers the daemon runs (one per user with clients)."""
        answer = control(self.binary, "get_server_list", self._full_env())
        return {int(tok) for tok in answer.split() if tok.isdigit()}

    def probe(self, argv: Sequence[str] | None = None, share: float = 0.5) -> str | None:
        """Make one CUDA context through the daemon and, while the context lives, ask the
        daemon for its servers; None when there is one (the context is an MPS client), else
        why not."""
        env = {**self._full_env(), PCT_ENV: str(percentage(share))}
        argv = list(argv) if argv is not None else [sys.executable, "-c", PROBE]
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            return f"the probe process failed: {e}"
        timer = threading.Timer(PROBE_TIMEOUT_S, proc.kill)
        timer.start()
        err = ""
        try:
            line = proc.stdout.readline() if proc.stdout is not None else ""
            if line.strip() == PROBE_READY:
                self.server_pids = self.servers()
            _, err = proc.communicate("")  # the probe exits once its stdin closes
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if line.strip() != PROBE_READY:
            return (f"a CUDA context under MPS failed (exit {proc.returncode}): "
                    f"{(err or '').strip()[-300:]}{self.log_tail()}")
        if not self.server_pids:
            return f"the probe's CUDA context did not start an MPS server{self.log_tail()}"
        return None

    def guard(self, lifeline_fd: int) -> subprocess.Popen | None:
        """Have our daemon quit once the launcher is gone, however it ends (SIGKILL too): a
        small process reads the launcher's lifeline (pdserve/child.py) to its end, then stops
        the daemon and removes its directory. Nothing for a daemon that is not ours."""
        if not self.owned:
            return None
        argv = [sys.executable, "-m", "pdserve.spatial", REAP, self.binary, self.pipe_dir,
                self.log_dir or "", self.tmp_dir or "", str(lifeline_fd)]
        return subprocess.Popen(argv, pass_fds=(lifeline_fd,), start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONSAFEPATH": "1"})

    def stop(self, timeout_s: float = 10.0) -> None:
        """Quit the daemon if it is ours (its server with it) and remove its directory."""
        if not self.owned:
            return
        pid = daemon_pid(self.pipe_dir)
        if pid is not None:
            try:
                self.server_pids |= self.servers()
                control(self.binary, "quit", self._full_env())
            except (OSError, subprocess.SubprocessError):
                pass
            deadline = time.monotonic() + timeout_s
            while daemon_pid(self.pipe_dir) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            for p in ([pid] if daemon_pid(self.pipe_dir) is not None else []) + \
                    sorted(self.server_pids):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        if self.tmp_dir:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None


@dataclass
class SpatialPlan:
    """Per role, the flags and environment that put a worker on its share of the SMs."""

    daemon: MpsDaemon
    shares: dict[str, float]

    def worker_args(self, role: str) -> list[str]:
        share = self.shares.get(role)
        return ["--sm-share", f"{share:g}"] if share is not None else []

    def close(self) -> None:
        self.daemon.stop()


def plan_spatial(device: str, gpus: int, prefill_share: float, decode_share: float,
                 binary: str | None = None, probe_argv: Sequence[str] | None = None
                 ) -> tuple[SpatialPlan | None, str]:
    """(plan, message): a plan with a working MPS daemon, or None and why not (then the
    workers share the GPU time-sliced)."""
    if not device.startswith("cuda"):
        return None, f"needs --device cuda (got {device})"
    if gpus < 1:
        return None, "no CUDA device is visible"
    found = binary or shutil.which(BINARY)
    if not found:
        return None, f"{BINARY} is not on PATH (CUDA MPS is not installed)"
    daemon = MpsDaemon.running(found)
    how = f"the MPS control daemon at {daemon.pipe_dir}" if daemon else ""
    if daemon is None:
        try:
            daemon = MpsDaemon.start(found)
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            return None, f"the MPS control daemon did not start: {e}"
        how = f"an MPS control daemon started for this cluster (pipe {daemon.pipe_dir})"
    why = daemon.probe(probe_argv)
    if why is not None:
        daemon.stop()
        return None, why
    shares = {"prefill": prefill_share, "decode": decode_share}
    return SpatialPlan(daemon, shares), (
        f"prefill workers on {percentage(prefill_share)}% and decode workers on "
        f"{percentage(decode_share)}% of the SMs, through {how}")


def _reap(argv: Sequence[str]) -> int:
    """MpsDaemon.guard's process: wait for end-of-file on the launcher's lifeline, then stop
    the daemon (a no-op where the launcher already did)."""
    binary, pipe, log_dir, tmp, fd = argv
    try:
        while os.read(int(fd), 4096):
            pass
    except OSError:
        pass
    MpsDaemon(binary, pipe, log_dir or None, owned=True, tmp_dir=tmp or None).stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != [REAP] or len(sys.argv) != 7:
        sys.exit(f"usage: python -m pdserve.spatial {REAP} BINARY PIPE_DIR LOG_DIR TMP_DIR FD")
    sys.exit(_reap(sys.argv[2:]))
