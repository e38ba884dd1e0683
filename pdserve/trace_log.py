"""What the trace summaries (`pdserve kvtrace`, `pdserve reqtrace`) share: reading the
`<tag> <stage> <id> <value>` lines of a stderr log, medians, and the command line that prints
a summary as JSON. A leaf of the import arrows, so that kvtransfer/ and engine/ can share it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Hashable


def first_stamps(lines: list[str], tag: str, key: Callable[[str], Hashable] = str,
                 stages: tuple[str, ...] | None = None) -> dict[Hashable, dict[str, float]]:
    """{key(id): {stage: value of its first line}} of the `<tag> <stage> <id> <value>` lines
    (anywhere in a line, after other output), only `stages` when given."""
    marker = tag + " "
    at: dict[Hashable, dict[str, float]] = {}
    for line in lines:
        parts = line[line.find(marker):].split() if marker in line else []
        if len(parts) == 4 and (stages is None or parts[1] in stages):
            at.setdefault(key(parts[2]), {}).setdefault(parts[1], float(parts[3]))
    return at


def median(values: list[float]) -> float:
    return round(sorted(values)[len(values) // 2], 3)


def summary_main(prog: str, doc: str, switch: str,
                 summarize: Callable[[list[str]], dict[str, float]],
                 argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("log", help=f"stderr of a run with {switch}=1")
    args = p.parse_args(argv)
    with open(args.log, errors="replace") as f:
        print(json.dumps(summarize(f.read().replace("\r", "\n").splitlines())))
    return 0
