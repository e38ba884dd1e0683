"""`--sm-share F`: a worker limited to a share of its GPU's SMs under CUDA MPS.

Without MPS, two CUDA processes on one GPU are time-sliced: a long prefill kernel in one holds
the whole GPU while the other's decode step waits. Under MPS (Multi-Process Service) their
kernels run at the same time, and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, read once when the
process creates its CUDA context, caps the SMs its kernels may occupy. So a prefill worker at
0.4 and a decode worker at 0.6 split one GPU spatially (`pdserve up --spatial` sets this up,
control daemon included; pdserve/spatial.py).

A client finds the MPS control daemon through `CUDA_MPS_PIPE_DIRECTORY` (default
`/tmp/nvidia-mps`); when none runs there, CUDA silently runs the process as a plain context,
so the share would have no effect: the worker says so and goes on with the whole GPU.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

PCT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
DRIVER_PIPE_DIR = "/tmp/nvidia-mps"  # where CUDA looks when CUDA_MPS_PIPE_DIRECTORY is unset
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the daemon, removed when it quits


def check_share(name: str, share: float) -> None:
    if not 0.0 < share <= 1.0:
        raise ValueError(f"{name}: must be in (0, 1], got {share}")


def percentage(share: float) -> int:
    """The active-thread percentage for a share of the SMs (at least 1)."""
    return max(1, min(100, round(share * 100)))


def pipe_dir(env: MutableMapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get(PIPE_ENV) or DRIVER_PIPE_DIR


def daemon_pid(directory: str) -> int | None:
    """The pid of the MPS control daemon serving `directory`, if it runs."""
    try:
        with open(os.path.join(directory, PID_FILE), encoding="ascii") as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except PermissionError:
        return pid  # a daemon another user (root) runs
    except OSError:
        return None
    return pid


def apply_sm_share(share: float, device: str,
                   env: MutableMapping[str, str] | None = None) -> str | None:
    """Cap this process (before its CUDA context exists) to `share` of the SMs; returns a
    warning when the cap cannot take effect, else None."""
    check_share("sm_share", share)
    if share >= 1.0:
        return None
    env = os.environ if env is None else env
    if device.startswith("cpu"):  # `auto` may still land on a GPU: set the cap for it
        return f"--sm-share {share:g} applies to CUDA workers; ignored on {device}"
    env[PCT_ENV] = str(percentage(share))
    directory = pipe_dir(env)
    if daemon_pid(directory) is None:
        return (f"--sm-share {share:g}: no MPS control daemon runs at {directory} "
                f"({PIPE_ENV}); the worker uses the whole GPU, time-sliced with other "
                f"processes on it")
    return None
