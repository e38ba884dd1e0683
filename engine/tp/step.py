"""Step messages from rank 0 to the other ranks of a tensor-parallel worker.

Rank 0 owns every scheduling decision. Before each forward pass it sends the pass's inputs
(a HostBatch: token ids, positions, KV slots, lengths) on the group's step channel; a follower
rebuilds the same ForwardBatch over its own KV pool (same page indices on every rank) and runs
the same forward pass, so the collectives inside it line up. Header words:
[kind, mode, batch_size, num_tokens, flags].
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.engine.forward_batch import ForwardMode, HostBatch
from pdserve.engine.tp.group import TPGroup

IDS_ON_DEVICE = 1  # flag: input ids are patched on rank 0's device; broadcast them there


class StepKind(enum.IntEnum):
    FORWARD = 1
    STOP = 2  # the worker is closing: leave the step loop


@dataclass
class Step:
    kind: StepKind
    batch: HostBatch | None = None
    ids_on_device: bool = False


def send_forward(group: TPGroup, batch: HostBatch, ids_on_device: bool) -> None:
    group.send_step([StepKind.FORWARD, batch.mode, batch.batch_size, batch.num_tokens,
                     IDS_ON_DEVICE if ids_on_device else 0], batch.data)


def send_stop(group: TPGroup) -> None:
    group.send_step([StepKind.STOP])


def recv_step(group: TPGroup) -> Step:
    header, payload = group.recv_step()
    kind = StepKind(header[0])
    if kind != StepKind.FORWARD:
        return Step(kind)
    batch = HostBatch(ForwardMode(header[1]), header[2], header[3], payload)
    return Step(kind, batch, bool(header[4] & IDS_ON_DEVICE))
