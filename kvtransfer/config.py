"""TransferConfig: how a worker moves KV pages (backend, bootstrap endpoint, timeouts)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

BACKENDS = ("auto", "shm", "tcp", "ucx", "cuda_ipc", "nixl")
IPC_COPIES = ("auto", "triton", "staged")


@dataclass(frozen=True)
class TransferConfig:
    """Frozen per-worker transfer settings; validation raises ValueError naming the field.

    backend: "auto" picks by where the peer is (kvtransfer/hosts.py): on one host shm (decode
    pool in shared memory) or cuda_ipc (decode pool on a GPU); across hosts nixl, else ucx,
    else tcp, whichever both sides have. A concrete name pins the backend; a pair it cannot
    serve (shm between two hosts, say) is refused at handshake naming both hosts.
    host_id: this worker's host identity ("" = hostname + kernel boot id).
    bootstrap_port 0 picks a free port (two clusters must run side by side).
    ipc_copy (cuda_ipc, sender side): how scattered pages reach the peer's pool. "triton": one
    kernel copies every page straight into the peer's mapped pool (kernels/page_p2p_copy.py),
    contiguous chunks included; "staged": gather -> one peer copy -> scatter; "auto": the
    kernel for scattered pages when Triton is there, plain peer copies for a few runs.
    stage_bytes (ucx): bytes per staged message; the gather of the next message overlaps the
    send of this one (0: 512 MiB for GPU pools, 16 MiB for host pools).
    """

    backend: str = "auto"
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    bootstrap_timeout_s: float = 10.0  # room created -> peer registered / handshake done
    waiting_timeout_s: float = 30.0  # registered -> first pages (prefill may be queueing)
    transfer_timeout_s: float = 30.0  # first pages -> every page and the aux data
    heartbeat_interval_s: float = 1.0
    heartbeat_misses: int = 5  # a peer silent for interval * misses fails all its rooms
    num_aux_slots: int = 1024  # decode: concurrent rooms (one aux slot each)
    finished_room_ttl_s: float = 30.0  # how long a finished room id is remembered (late drops)
    ipc_copy: str = "auto"
    host_id: str = ""
    stage_bytes: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: {self.backend!r} is not one of {BACKENDS}")
        if self.ipc_copy not in IPC_COPIES:
            raise ValueError(f"ipc_copy: {self.ipc_copy!r} is not one of {IPC_COPIES}")
        if not 0 <= self.bootstrap_port <= 65535:
            raise ValueError(f"bootstrap_port: must be in [0, 65535], got {self.bootstrap_port}")
        for f in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s",
                  "heartbeat_interval_s", "finished_room_ttl_s"):
            if not float(getattr(self, f)) > 0:
                raise ValueError(f"{f}: must be positive, got {getattr(self, f)}")
        if self.heartbeat_misses < 1:
            raise ValueError(f"heartbeat_misses: must be >= 1, got {self.heartbeat_misses}")
        if self.stage_bytes < 0:
            raise ValueError(f"stage_bytes: must be >= 0, got {self.stage_bytes}")
        if self.host_id != self.host_id.strip():
            raise ValueError(f"host_id: no surrounding spaces, got {self.host_id!r}")
        if self.num_aux_slots < 1:
            raise ValueError(f"num_aux_slots: must be >= 1, got {self.num_aux_slots}")

    @property
    def heartbeat_window_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    """The workers' transfer flags; defaults are TransferConfig's."""
    c = TransferConfig
    p.add_argument("--transfer-backend", default=c.backend, help="|".join(BACKENDS))
    p.add_argument("--bootstrap-port", type=int, default=c.bootstrap_port,
                   help="KV bootstrap port (prefill; 0 = a free one)")
    p.add_argument("--bootstrap-timeout", type=float, default=c.bootstrap_timeout_s)
    p.add_argument("--waiting-timeout", type=float, default=c.waiting_timeout_s)
    p.add_argument("--transfer-timeout", type=float, default=c.transfer_timeout_s)
    p.add_argument("--heartbeat-interval", type=float, default=c.heartbeat_interval_s)
    p.add_argument("--heartbeat-misses", type=int, default=c.heartbeat_misses,
                   help="a KV peer silent for interval x misses fails all its rooms")
    p.add_argument("--host-id", default=c.host_id,
                   help="the host identity this worker announces to KV peers (default: "
                        "hostname + boot id); peers with equal ids use shm / cuda_ipc")


def transfer_config_from_args(args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(
        backend=args.transfer_backend, bootstrap_host=args.host,
        bootstrap_port=args.bootstrap_port, bootstrap_timeout_s=args.bootstrap_timeout,
        waiting_timeout_s=args.waiting_timeout, transfer_timeout_s=args.transfer_timeout,
        heartbeat_interval_s=args.heartbeat_interval, heartbeat_misses=args.heartbeat_misses,
        host_id=args.host_id)
