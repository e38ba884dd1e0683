"""One JSON line per forward step of a Scheduler, when `PDSERVE_STEP_TRACE` names a folder.

The same lines come from the offline engine and from every worker, so that a served run can be
set beside the offline one step by step (`python -m pdserve.bench.step_trace` summarizes them
per time window): how many extend and decode steps ran, how long each took at which batch size,
and how much of the time the scheduler ran no step at all (waiting for requests, or busy with
its inbox between steps).

A line: {"t": wall-clock start (s), "dt": duration (s), "mode": "extend" | "decode",
"n": tokens of an extend batch or requests of a decode step, "running": .., "waiting": ..}.
The first line of a file says which process wrote it. Lines are buffered and written every
`FLUSH_EVERY` steps, when the scheduler thread finds nothing to run, and at exit: the cost per
step is a tuple append.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading

from pdserve.envs import envs

FLUSH_EVERY = 512


class StepTrace:
    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        # One file per scheduler (a process may build more than one: warm-up, TP ranks).
        self.path = os.path.join(folder, f"steps-{os.getpid()}-{id(self):x}.jsonl")
        self._rows: list[tuple] = []
        self._lock = threading.Lock()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv}) + "\n")
        atexit.register(self.flush)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        folder = envs().step_trace
        return cls(folder) if folder else None

    def record(self, wall: float, dt: float, mode: str, n: int, running: int,
               waiting: int) -> None:
        self._rows.append((wall, dt, mode, n, running, waiting))
        if len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
            if not rows:
                return
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps({"t": round(t, 6), "dt": round(dt, 6), "mode": m,
                                         "n": n, "running": r, "waiting": w}) + "\n"
                             for t, dt, m, n, r, w in rows)
