"""What a benchmark says when the `pdserve up` it started exits before its `ready` line."""

from __future__ import annotations


def exited_before_ready(what: str, code: int, lines: list[str]) -> RuntimeError:
    """The exit code and the last lines it printed: a worker's own error, say, or an
    out-of-memory one."""
    return RuntimeError(f"{what} exited {code} before ready: "
                        + "".join(lines[-5:]).strip()[-600:])
