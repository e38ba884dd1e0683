"""What the kernels ask of the device they run on: its compute capability (PDL, TMA) and its
SM count (grid sizes), each read once per device; and host-to-device copies that do not block."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else 0


def hopper_or_later(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9 or more (PDL, TMA)."""
    return device.type == "cuda" and _capability(_index(device))[0] >= 9


def num_sms(device: torch.device) -> int:
    """The SM count of a CUDA device (4 elsewhere: the CPU interpreter's stand-in)."""
    return _sms(_index(device)) if device.type == "cuda" else 4


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; on CUDA through pinned staging, asynchronously: a copy from
    pageable memory may wait for the GPU to drain, which would undo overlap scheduling."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
