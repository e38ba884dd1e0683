"""A worker's tensor-parallel group: the collectives the model runs, and the step channel from
rank 0 to the other ranks.

Two process groups over one TCPStore (rank 0 hosts it): `device` for the model's tensors (NCCL
on CUDA, gloo on CPU) and `cpu` (always gloo) for step messages, which are host data and must
not queue behind GPU work. They are standalone process groups, not torch.distributed's default
group: no process-wide state, so an offline LLM, a benchmark or a test can make and close
several in one process.

With one rank there is no group and every collective returns its input: TP=1 runs exactly the
single-device code. `TPGroup.connect(..., size=1)` makes a real group of one instead (the GPU
check captures CUDA graphs with its all-reduce in them).

Invariant: every rank issues the same collectives in the same order. Rank 0 decides what runs
and announces it (`send_step`) before it runs; the other ranks run only what they receive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

HEADER_LEN = 8  # int64 words of a step message header; the last one is the payload length
# The step channel waits as long as a worker idles; a dead peer ends the wait at once (its
# socket closes). The device group's collectives run inside forward passes only.
_IDLE_TIMEOUT = timedelta(days=365)
DEVICE_TIMEOUT = timedelta(minutes=10)


@dataclass
class TPGroup:
    """Rank `rank` of `size`. `device` / `cpu`: the process groups (None with one rank)."""

    rank: int = 0
    size: int = 1
    device: Any = None
    cpu: Any = None

    @property
    def active(self) -> bool:
        """Whether collectives run (a group exists, even of one rank)."""
        return self.device is not None

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, device: torch.device,
                device_timeout: timedelta = DEVICE_TIMEOUT) -> TPGroup:
        """Joins the group (blocks until all `size` ranks called it with the same store)."""
        device = torch.device(device)
        cpu = dist.ProcessGroupGloo(dist.PrefixStore("tp-cpu/", store), rank, size,
                                    _IDLE_TIMEOUT)
        if device.type == "cuda":
            if device.index is None:  # set_device needs an index ("cuda" = the current one)
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = device_timeout
            dev = dist.ProcessGroupNCCL(dist.PrefixStore("tp-dev/", store), rank, size, opts)
        else:
            dev = dist.ProcessGroupGloo(dist.PrefixStore("tp-dev/", store), rank, size,
                                        device_timeout)
        return cls(rank, size, dev, cpu)

    # ---- collectives of the model (every rank, same order) ------------------------------------

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; returns it."""
        if self.device is not None:
            self.device.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's part at columns [r*n, (r+1)*n)."""
        if self.device is None:
            return x
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self.device._allgather_base(out, x).wait()
        parts = out.view(self.size, *x.shape)
        return parts.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (device group), in place."""
        if self.device is not None:
            self.device.broadcast(x, 0).wait()
        return x

    # ---- step channel (rank 0 -> the others, host data) ---------------------------------------

    def send_step(self, header: Sequence[int], payload: torch.Tensor | None = None) -> None:
        """Rank 0: announce one step. `header`: up to HEADER_LEN - 1 ints; `payload`: int64."""
        n = 0 if payload is None else payload.numel()
        h = torch.zeros(HEADER_LEN, dtype=torch.int64)
        h[:len(header)] = torch.tensor(list(header), dtype=torch.int64)
        h[-1] = n
        self.cpu.broadcast(h, 0).wait()
        if n:
            self.cpu.broadcast(payload.reshape(-1).to(torch.int64).contiguous(), 0).wait()

    def recv_step(self) -> tuple[list[int], torch.Tensor]:
        """Ranks > 0: the next step's header and payload (blocks while rank 0 idles)."""
        h = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.cpu.broadcast(h, 0).wait()
        header = h.tolist()
        payload = torch.empty(header[-1], dtype=torch.int64)
        if header[-1]:
            self.cpu.broadcast(payload, 0).wait()
        return header[:-1], payload

    def barrier(self) -> None:
        """All ranks reach this point (step channel)."""
        if self.cpu is not None:
            self.cpu.allreduce([torch.zeros(1)]).wait()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (step channel)."""
        if self.cpu is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.cpu.allreduce([t], opts).wait()
        return int(t.item())


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """The device of rank `rank` of a worker on `device`: the same CPU, or the rank-th GPU
    counted from the one named (`cuda` = `cuda:0`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)
