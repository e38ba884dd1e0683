"""What a benchmark says when the `pdserve up` it started exits before its `ready` line."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

TAIL = 5  # lines of its output the message quotes


def tail() -> deque[str]:
    """Where a caller keeps the last TAIL lines while it reads the output."""
    return deque(maxlen=TAIL)


def exited_before_ready(what: str, code: int, lines: Sequence[str]) -> RuntimeError:
    """The exit code and the last lines it printed: a worker's own error, say, or an
    out-of-memory one."""
    return RuntimeError(f"{what} exited {code} before ready: "
                        + "".join(list(lines)[-TAIL:]).strip()[-600:])
