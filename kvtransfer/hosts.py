"""Where a peer is, and the backend that follows from it.

Each KVManager names its host at handshake: hostname + kernel boot id. Two workers that agree
share a kernel, so a shared-memory segment or a CUDA IPC handle of one can be opened by the
other; two that differ (another node, or another pod with its own hostname) cannot, and their
KV must travel over the network. TransferConfig.host_id (`--host-id`) replaces the detected
identity (tests fake a second host this way; a deployment can give containers that do share
/dev/shm and GPUs one id).

Prefill chooses, from what decode offers, best first:
same host: shm (decode pool in shared memory), cuda_ipc (GPU pools) — one-sided, no network;
different hosts (or neither of those usable): nixl (one-sided RDMA/TCP writes into registered
pages), ucx (tagged messages through staging buffers), tcp (pyzmq, always there).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SAME_HOST_BACKENDS = ("shm", "cuda_ipc")  # memory only processes of one host can map
CROSS_HOST_BACKENDS = ("nixl", "ucx", "tcp")  # best first


def machine_id() -> str:
    """hostname/boot-id of the kernel this process runs on (never overridden)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def host_id(override: str = "") -> str:
    """The identity a worker announces: `override` (TransferConfig.host_id), else machine_id()."""
    return override or machine_id()


@dataclass(frozen=True)
class Choice:
    """The backend for one (prefill, decode) pair, or "" with the reason none fits."""

    backend: str
    reason: str


def choose_backend(offers: Sequence[str], configured: str, prefill_host: str,
                   decode_host: str, usable: Callable[[str], str | None]) -> Choice:
    """Pick what prefill uses towards one decode peer.

    offers: decode's backends, best first. configured: prefill's TransferConfig.backend
    ("auto" or a name it is pinned to). usable(name): None when prefill can use `name` for this
    peer, else why not (not importable here, segment not reachable, pool not on a GPU...).
    """
    same = prefill_host == decode_host
    where = (f"same host {prefill_host!r}" if same else
             f"different hosts (prefill {prefill_host!r}, decode {decode_host!r})")
    order = (configured,) if configured != "auto" else SAME_HOST_BACKENDS + CROSS_HOST_BACKENDS
    skipped: list[str] = []
    for name in order:
        if name not in offers:
            if configured != "auto" or name not in SAME_HOST_BACKENDS:  # else: not its kind
                skipped.append(f"{name}: decode does not offer it")
            continue
        if name in SAME_HOST_BACKENDS and not same:
            skipped.append(f"{name}: needs prefill and decode on one host")
            continue
        why = usable(name)
        if why is not None:
            skipped.append(f"{name}: {why}")
            continue
        tail = f" (skipped {'; '.join(skipped)})" if skipped else ""
        return Choice(name, f"{where}: {name}{tail}")
    pinned = f"prefill pinned to {configured!r}, " if configured != "auto" else ""
    return Choice("", f"backend: no usable backend for {where}: {pinned}decode offers "
                      f"{list(offers)}; {'; '.join(skipped) or 'nothing to try'}")


def offers_for(configured: str, shm_pool: bool, gpu_pool: bool,
               importable: Callable[[str], bool]) -> list[str]:
    """What a decode worker offers, best first: its same-host path, then every cross-host
    backend this process can run (prefill picks by host). A pinned backend is offered alone."""
    if configured != "auto":
        return [configured]
    names = ["shm"] if shm_pool else []
    names += ["cuda_ipc"] if gpu_pool else []
    names += [n for n in CROSS_HOST_BACKENDS if n == "tcp" or importable(n)]
    return names
