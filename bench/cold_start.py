"""Cold start: how the first wave of requests after `pdserve up` prints `ready` compares with the
waves after it, with the workers' warm-up and without it (`--skip-warmup`), in one run.

    python -m pdserve.bench.cold_start [--model PATH] [--waves 10] [--concurrency 4]

Per variant: start `pdserve up` (the default model and layout unless told otherwise), time it to
`ready`, then send 1 + `--waves` waves of `--concurrency` concurrent streamed chat completions
(greedy, `--max-tokens` each) and time each wave from its first request sent to its last
answer complete. Every request has its own system prompt, so no wave finds another's prompt in
the radix cache: a later wave is not faster for having seen the same tokens. Prints, per
variant, the ready time, the first wave, the median of the rest and their ratio (target: at
most 1.5 with the warm-up), and TTFT of the first wave against the median TTFT of the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx

from pdserve.bench.up_ready import exited_before_ready, tail

TOPICS = ("rivers", "bread", "winter", "trains", "bees", "copper", "maps", "violins",
          "salt", "kites", "glass", "owls", "tides", "paper", "lanterns", "deserts",
          "clocks", "ferns", "harbors", "comets", "wool", "bridges", "tea", "caves",
          "orchards", "sailing", "marble", "pepper", "storms", "honey", "ink", "moss",
          "volcanoes", "canals", "chess", "pottery", "gardens", "whales", "lightning", "silk",
          "tunnels", "baskets", "meteors", "olives")


def start(args: argparse.Namespace, warm: bool) -> tuple[subprocess.Popen, str, float]:
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", "0"]
    cmd += ["--model", args.model] if args.model else []
    cmd += [] if warm else ["--worker-arg=--skip-warmup"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    last = tail()
    for line in proc.stdout:
        if line.startswith("pdserve ready"):
            return proc, line.split()[2], time.perf_counter() - t0
        last.append(line)
    raise exited_before_ready("pdserve up", proc.wait(), last)


async def one(http: httpx.AsyncClient, topic: str, index: int, max_tokens: int) -> float:
    """A streamed chat completion; returns its TTFT in seconds."""
    body = {"messages": [
        {"role": "system", "content": f"{topic.capitalize()} expert number {index}: answer "
                                      "in one plain sentence."},
        {"role": "user", "content": f"Tell me something about {topic}."}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft = 0.0
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not ttft and line.startswith("data: {") and '"content": "' in line \
                    and '"content": ""' not in line:
                ttft = time.perf_counter() - t0
    return ttft


async def waves(url: str, args: argparse.Namespace) -> list[tuple[float, list[float]]]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for w in range(1 + args.waves):
            batch = [(TOPICS[(w * args.concurrency + i) % len(TOPICS)], w * 100 + i)
                     for i in range(args.concurrency)]
            t0 = time.perf_counter()
            ttfts = await asyncio.gather(*(one(http, t, i, args.max_tokens) for t, i in batch))
            out.append((time.perf_counter() - t0, list(ttfts)))
    return out


def variant(args: argparse.Namespace, warm: bool) -> dict:
    proc, url, ready_s = start(args, warm)
    try:
        times = asyncio.run(waves(url, args))
    finally:
        proc.terminate()
        proc.wait(120)
    first, rest = times[0], times[1:]
    median = statistics.median(t for t, _ in rest)
    rest_ttft = statistics.median(x for _, ts in rest for x in ts)
    return {"warmup": warm, "ready_s": ready_s, "first_wave_s": first[0],
            "median_wave_s": median, "ratio": first[0] / median,
            "first_wave_ttft_s": max(first[1]), "median_ttft_s": rest_ttft,
            "waves_s": [t for t, _ in times]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.cold_start",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--waves", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--only-warm", action="store_true", help="skip the --skip-warmup variant")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = [variant(args, True)] + ([] if args.only_warm else [variant(args, False)])
    for r in results:
        if args.json:
            print(json.dumps(r))
            continue
        name = "with warm-up" if r["warmup"] else "--skip-warmup"
        print(f"{name:14} ready {r['ready_s']:6.1f} s | first wave {r['first_wave_s']:6.2f} s,"
              f" median of the next {args.waves} {r['median_wave_s']:5.2f} s, ratio "
              f"{r['ratio']:4.2f} (target <= 1.5) | TTFT first wave (max) "
              f"{r['first_wave_ttft_s']:5.2f} s, median after {r['median_ttft_s']:5.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
