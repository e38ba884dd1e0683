"""One process of a `pdserve up` cluster, and how every such process dies with the launcher.

Lifetime: the launcher opens one pipe and keeps the write end to itself (`Lifeline`); every
child inherits the read end, named by PDSERVE_LAUNCHER_FD, and watches it from a thread
(`watch_launcher`, run by the `pdserve` command before any subcommand). The launcher never
writes, so the read returns end-of-file exactly when the launcher is gone, whatever ended it
(SIGKILL included: the kernel closes a dead process's descriptors). The child then stops as on
SIGTERM, and a second SIGTERM HURRY_S later makes it stop at once instead of draining: its
router goes away too, so nothing is left to drain for. A pipe rather than PR_SET_PDEATHSIG:
that signal fires when the *thread* that forked the child ends, and is Linux-only.

Output: a child's lines are echoed on the launcher's stdout (prefixed with its name once it is
ready); its `<prefix> ready k=v ...` line is parsed, not echoed.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

LAUNCHER_FD_ENV = "PDSERVE_LAUNCHER_FD"
HURRY_S = 0.5  # between the two SIGTERMs (one signal pending twice is delivered once)


class Lifeline:
    """The launcher's end of the pipe; `env()` hands the read end to children."""

    def __init__(self) -> None:
        # os.pipe() descriptors are not inherited: only children given `pass_fds` get the read
        # end, and no child ever holds the write end (or the pipe would never close).
        self.read_fd, self._write_fd = os.pipe()

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, LAUNCHER_FD_ENV: str(self.read_fd)}


@dataclass
class Child:
    name: str
    prefix: str  # its ready line starts with "<prefix> ready"
    popen: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)
    ready: dict[str, str] = field(default_factory=dict)
    _ready: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def spawn(cls, name: str, prefix: str, argv: list[str], env: dict[str, str],
              lifeline: Lifeline) -> Child:
        # Its own session: a terminal's Ctrl-C reaches the launcher only, which stops the
        # children in order (workers drain first).
        # PYTHONSAFEPATH: `-m` would put the working directory first on sys.path, and from a
        # checkout of this repository its top-level kernels/ would shadow the `kernels`
        # package that transformers imports (a dependency of transformers >= 5.25).
        popen = subprocess.Popen([sys.executable, "-m", "pdserve", *argv],
                                 stdout=subprocess.PIPE, text=True,
                                 env={**lifeline.env(env), "PYTHONSAFEPATH": "1"},
                                 start_new_session=True, pass_fds=(lifeline.read_fd,))
        child = cls(name, prefix, popen)
        threading.Thread(target=child._read, name=f"{name}-output", daemon=True).start()
        return child

    def _read(self) -> None:
        for line in self.popen.stdout:  # type: ignore[union-attr]
            if not self._ready.is_set() and line.startswith(f"{self.prefix} ready"):
                self.ready = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
                self._ready.set()
            elif self._ready.is_set():
                sys.stdout.write(f"[{self.name}] {line}")
            else:
                sys.stdout.write(line)

    def wait_ready(self, deadline: float, stop: threading.Event) -> dict[str, str]:
        """The fields of its ready line; RuntimeError if it exits, the deadline passes or
        `stop` is set first."""
        while not self._ready.wait(0.1):
            if self.popen.poll() is not None:
                self._ready.wait(0.5)  # the reader may still be on the last lines
                if self._ready.is_set():
                    break
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode} before "
                                   f"ready")
            if stop.is_set():
                raise RuntimeError(f"stopped while {self.name} was starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: not ready in time")
        return self.ready

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL its whole session (whatever it started too), then reap it."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()


def watch_launcher() -> None:
    """In a child of `pdserve up`: stop when the launcher is gone (see the module docstring).
    Elsewhere (PDSERVE_LAUNCHER_FD unset, or not a pipe): nothing."""
    from pdserve.envs import envs

    fd = envs().launcher_fd
    os.environ.pop(LAUNCHER_FD_ENV, None)  # not for the processes this one starts
    if fd is None:
        return
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
    except OSError:
        return

    def watch() -> None:
        try:
            while os.read(fd, 64):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(HURRY_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
