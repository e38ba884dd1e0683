"""Shared-memory KV pools (and notification sockets) whose creator was killed are swept by the
next pool; live ones stay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from pdserve.kvtransfer.shm_pool import SHM_DIR, alloc_shm_pool, sweep_stale_segments

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")

CHILD = """
import sys, time, torch
from pdserve.kvtransfer.shm_pool import alloc_shm_pool
from pdserve.kvtransfer.backends.same_host import NotifyListener
buf = alloc_shm_pool(4, 2, 4, 2, 8, torch.float32)
sock = NotifyListener(lambda header, token: None)
print(buf.name, sock.path, flush=True)
time.sleep(60)
"""


def test_killed_creators_segment_is_swept_and_live_ones_stay():
    live = alloc_shm_pool(4, 2, 4, 2, 8, torch.float32)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        dead_name, dead_sock = child.stdout.readline().split()
        assert os.path.exists(f"{SHM_DIR}/{dead_name}") and os.path.exists(dead_sock)
        os.killpg(child.pid, signal.SIGKILL)  # the child and its resource tracker alike
        child.wait(10)
        removed = sweep_stale_segments()
        assert dead_name in removed
        assert not os.path.exists(f"{SHM_DIR}/{dead_name}")
        assert not os.path.exists(f"{SHM_DIR}/{dead_name}.lock")
        assert not os.path.exists(dead_sock)
        assert not os.path.exists(dead_sock.removesuffix(".sock") + ".lock")
        assert live.name not in removed and os.path.exists(f"{SHM_DIR}/{live.name}")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        live.close()
    assert not os.path.exists(f"{SHM_DIR}/{live.name}")
    assert not os.path.exists(f"{SHM_DIR}/{live.name}.lock")
