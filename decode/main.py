"""`pdserve decode`: run a decode worker."""

from __future__ import annotations

from pdserve.engine.worker_main import run


def main(argv: list[str] | None = None) -> int:
    return run("decode", argv)
