"""`pdserve mixed`: prefill and decode in one process, no transfer (the colocated baseline)."""

from __future__ import annotations

from pdserve.engine.worker_main import run


def main(argv: list[str] | None = None) -> int:
    return run("mixed", argv)
