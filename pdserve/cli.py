"""The `pdserve` command: one entry point, each subcommand implemented by its component.

Subcommands are imported lazily so `pdserve kvbench` does not load transformers and
`pdserve router` does not load torch kernels it never uses.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from pdserve.child import watch_launcher
from pdserve.envs import envs

# subcommand -> ("module[:function]", help); the function (default `main`) takes the argv
# after the subcommand and returns the exit status.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdserve.launcher", "start router + prefill + decode workers on this machine"),
    "router": ("pdserve.router.main", "run the router (gRPC + OpenAI-compatible HTTP)"),
    "prefill": ("pdserve.prefill.main", "run a prefill worker"),
    "decode": ("pdserve.decode.main", "run a decode worker"),
    "mixed": ("pdserve.decode.main:main_mixed",
              "run a worker doing prefill and decode (no transfer)"),
    "generate": ("pdserve.engine.generate_cli", "offline generation from a JSONL prompt file"),
    "kvbench": ("pdserve.bench.kv", "benchmark KV page transfer between two processes"),
    "kvtrace": ("pdserve.kvtransfer.trace", "stage medians of a PDSERVE_KV_TRACE=1 log"),
    "reqtrace": ("pdserve.engine.req_trace", "per-hop medians of a PDSERVE_REQ_TRACE=1 log"),
    "bench": ("pdserve.bench.serve", "serving load generator (TTFT, ITL, goodput)"),
}


# Long-running servers: run from the command line, they leave with os._exit once they have
# released what they own (drained, deregistered, KV and shared memory closed). The interpreter's
# own finalization, a full garbage collection over everything torch and transformers created,
# took 3-4 s per worker on the 2-core CI machine; a stopped cluster is gone in well under that.
SERVERS = ("up", "router", "prefill", "decode", "mixed")


def _usage() -> str:
    lines = ["usage: pdserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from pdserve import __version__

        print(f"pdserve {__version__}")
        return 0
    name = args[0]
    if name not in SUBCOMMANDS:
        print(f"pdserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        envs()  # a malformed PDSERVE_* switch stops the process here, not mid-request
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    watch_launcher()  # a child of `pdserve up` stops when the launcher is gone
    module_name, _, func = SUBCOMMANDS[name][0].partition(":")
    entry = getattr(importlib.import_module(module_name), func or "main")
    code = int(entry(args[1:]) or 0)
    if argv is None and name in SERVERS:  # the real command line, not a call in a process
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
