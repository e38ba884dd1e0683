"""Programmatic dependent launch (PDL, Hopper and later) for our Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running:
each of its programs first lets the next kernel be scheduled (`griddepcontrol.launch_dependents`)
and then waits until the previous kernel has finished and its writes are visible
(`griddepcontrol.wait`) before reading anything. So the launch latency and the ramp-up of one
kernel overlap the tail of the one before, which matters where kernels last a few microseconds
(batch-1 decode). Kernels before or after that do not use PDL are ordered as usual; a CUDA graph
keeps the programmatic edges. PDSERVE_PDL=0 turns it off (pdserve/envs.py); a kernel wrapper's
`pdl` argument, where it has one, decides for one launch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.envs import envs
from pdserve.kernels.device import hopper_or_later


def use_pdl(device: torch.device) -> bool:
    """Whether to launch with PDL on `device` (never in the CPU interpreter: TRITON_INTERPRET is
    Triton's own variable, which the kernel tests set before importing Triton)."""
    return (envs().pdl and os.environ.get("TRITON_INTERPRET") != "1"
            and hopper_or_later(device))


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Lets the next kernel be scheduled, then waits until the previous one has finished."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
