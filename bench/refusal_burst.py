"""How fast an overloaded router refuses: N streaming completions sent at once over raw sockets.

    python -m pdserve.bench.refusal_burst --url http://127.0.0.1:8000 --clients 256

Start the cluster with a low queue bound (`pdserve up --router-arg=--max-queued-requests=8`).
Each client opens its own connection and writes a prebuilt request; the time to a 429's
status line is the router's (the client does next to nothing per request, unlike an HTTP
library's, whose per-request work on one event loop adds up over a burst of hundreds). Prints
the refusals' p50 and max seconds and when the first admitted stream ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.parse


async def _one(host: str, port: int, i: int, max_tokens: int) -> tuple[int, float, float]:
    body = json.dumps({"prompt": f"client {i}: the quick brown fox", "stream": True,
                       "max_tokens": max_tokens, "temperature": 0.7,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head.encode() + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    t_status = time.monotonic() - t0
    while await reader.read(1 << 16):  # the stream, to its end (Connection: close)
        pass
    writer.close()
    return status, t_status, time.monotonic() - t0


async def burst(url: str, clients: int, max_tokens: int) -> dict:
    parts = urllib.parse.urlsplit(url)
    res = await asyncio.gather(*(_one(parts.hostname or "127.0.0.1", parts.port or 80, i,
                                      max_tokens) for i in range(clients)))
    refused = sorted(t for status, t, _ in res if status == 429)
    served = sorted(end for status, _, end in res if status == 200)
    out = {"clients": clients, "refused": len(refused), "served": len(served),
           "other": sorted({status for status, _, _ in res} - {200, 429})}
    if refused:
        out |= {"refused_p50_s": round(refused[len(refused) // 2], 3),
                "refused_max_s": round(refused[-1], 3)}
    if served:
        out["first_served_s"] = round(served[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.refusal_burst",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the router's HTTP address")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(burst(args.url, args.clients, args.max_tokens))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
