"""The GPU's SM clock and power draw while a block of work runs, sampled by nvidia-smi every
20 ms in a background process (medians): whether a long run holds the clocks that a short
burst gets. Empty where nvidia-smi is missing or sampled nothing (a block shorter than its
start-up, about 0.1-0.3 s).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


@contextmanager
def sampled_clocks(into: dict[str, float]) -> Iterator[None]:
    """Fills `into` with sm_clock_mhz, power_w (medians), clock_reasons (the most frequent
    clocks_event_reasons.active bit mask: 0x4 software power cap, 0x20 software thermal,
    0x40 hardware thermal, 0x80 hardware power brake) and samples after the block."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        yield
        return
    proc = subprocess.Popen([exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                             "-lms", "20"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    time.sleep(0.3)  # its start-up, so that the samples cover the block
    start = datetime.now()
    try:
        yield
    finally:
        end = datetime.now()
        proc.terminate()
        out = proc.communicate(timeout=10)[0]
        rows = []
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                at = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
                if start <= at <= end:  # only samples taken while the block ran
                    rows.append((float(parts[1]), float(parts[2]), parts[3]))
            except (ValueError, IndexError):
                continue
        if rows:
            into.update(sm_clock_mhz=statistics.median(r[0] for r in rows),
                        power_w=round(statistics.median(r[1] for r in rows), 1),
                        clock_reasons=statistics.mode(r[2] for r in rows),
                        samples=len(rows))
