"""The command line of a trace summary (`pdserve kvtrace`, `pdserve reqtrace`): read the
stderr log a run with the trace switched on wrote, print its summary as JSON. A leaf of the
import arrows, so that kvtransfer/ and engine/ can share it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable


def summary_main(prog: str, doc: str, switch: str,
                 summarize: Callable[[list[str]], dict[str, float]],
                 argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("log", help=f"stderr of a run with {switch}=1")
    args = p.parse_args(argv)
    with open(args.log, errors="replace") as f:
        print(json.dumps(summarize(f.read().replace("\r", "\n").splitlines())))
    return 0
