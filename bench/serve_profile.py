"""py-spy over the served processes during a workload (`scripts/serve-bench --py-spy`): one
`py-spy record` per process (router, each worker) while the load runs, folded stacks per thread
in OUT/pyspy/, and a summary of where each process's threads were on the CPU.

    python -m pdserve.bench.serve_profile FILE.txt ...     (the summary of recorded files again)

py-spy samples without pausing the target (`--nonblocking`) and leaves out idle threads, so a
thread's samples over the recording's samples per second are the share of a core it was busy
(holding or waiting for the GIL included; `--gil` would count only the holder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

RATE_HZ = 100


def available() -> str | None:
    return shutil.which("py-spy")


class Recorders:
    """A `py-spy record` per {role: pid} until stop()."""

    def __init__(self, pids: dict[str, int], folder: str, tag: str) -> None:
        exe = available()
        self.files: dict[str, str] = {}
        self.procs: list[subprocess.Popen] = []
        self.t0 = time.perf_counter()
        if exe is None:  # the benchmark runs on without it
            print("serve-bench: --py-spy: py-spy is not on PATH", file=sys.stderr, flush=True)
            return
        os.makedirs(folder, exist_ok=True)
        for role, pid in pids.items():
            path = os.path.join(folder, f"{tag}-{role}.txt")
            log = open(path + ".log", "w", encoding="utf-8")  # noqa: SIM115 (closed in stop)
            self.procs.append(subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--nonblocking",
                 "--threads", "--format", "raw", "-o", path], stdout=log, stderr=log))
            self.files[role] = path
        self.t0 = time.perf_counter()

    def stop(self) -> dict[str, dict]:
        """Stop the recorders (py-spy writes its file on SIGINT); {role: summary}."""
        seconds = time.perf_counter() - self.t0
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        out = {}
        for role, path in self.files.items():
            try:
                out[role] = dict(summarize(path), seconds=round(seconds, 2))
            except OSError as e:
                out[role] = {"error": f"{e}"}
        return out


def _frame(text: str) -> str:
    """`fn (path/file.py:123)` -> `fn (file.py)`."""
    name, _, where = text.partition(" (")
    return f"{name} ({os.path.basename(where.split(':')[0].rstrip(')'))})" if where else name


def summarize(path: str, top: int = 12) -> dict:
    """Samples per thread, and the frames with the most self samples (the innermost frame of
    each stack), from a `py-spy record --format raw --threads` file."""
    threads: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    per_thread: dict[str, Counter[str]] = {}
    total = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            name = frames[0].partition(": ")[2] or frames[0]  # `thread (TID): NAME`
            threads[name] += n
            self_time[_frame(frames[-1])] += n
            per_thread.setdefault(name, Counter())[_frame(frames[-1])] += n

    def shares(c: Counter[str], k: int) -> list[tuple[str, float]]:
        return [(f, round(n / max(total, 1), 3)) for f, n in c.most_common(k)]

    return {"samples": total, "rate_hz": RATE_HZ,
            "threads": {t: n for t, n in threads.most_common(8)},
            "self": shares(self_time, top),
            "by_thread": {t: shares(per_thread[t], 6) for t, _ in threads.most_common(3)}}


def table(role: str, s: dict) -> str:
    if "error" in s:
        return f"{role}: {s['error']}"
    lines = [f"{role}: {s['samples']} samples at {s['rate_hz']} Hz"]
    per_s = s["rate_hz"] * s["seconds"] if s.get("seconds") else max(s["samples"], 1)
    unit = "of a core" if s.get("seconds") else "of the samples"
    lines += [f"  thread {t}: {n} samples ({n / per_s:.0%} {unit})"
              for t, n in s["threads"].items()]
    lines += [f"  {share:6.1%}  {frame}" for frame, share in s["self"]]
    for t, top in s.get("by_thread", {}).items():
        lines.append(f"  in {t}: " + ", ".join(f"{f} {share:.1%}" for f, share in top))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.serve_profile",
                                description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    for path in args.files:
        print(table(os.path.basename(path), summarize(path, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
