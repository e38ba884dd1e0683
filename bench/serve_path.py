"""CPU time of the serving path per streamed token and per request: a cluster whose engine is
cheap (the `tiny` shape, random weights) under `pdserve bench` at a given concurrency, with the
router's and the worker's CPU seconds (from /proc) divided by the output tokens and by the
requests (`--output-len 1` makes the per-request cost the whole of it).

    python -m pdserve.bench.serve_path [--clients 64] [--num-prompts 384] [--topology mixed]
                                       [--router-arg=--no-worker-session]

On a small CPU machine the engine is still slow, but what the router spends per token does not
depend on how fast tokens come: this is the figure that says how many tokens per second one
router process can carry (1 / (router seconds per token)).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from pdserve.bench.serve_cluster import Cluster
from pdserve.bench.serve_compare import Workload, bench_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.serve_path",
                                description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=384)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--topology", default="mixed", choices=("mixed", "pd"))
    p.add_argument("--model-shape", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                   help="an extra router flag (e.g. --router-arg=--no-worker-session)")
    args = p.parse_args(argv)
    args.out = args.out or tempfile.mkdtemp(prefix="serve-path-")
    w = Workload("x", args.clients, args.input_len, args.output_len, args.num_prompts)
    args.num_pages = w.clients * -(-(w.input_len + w.output_len) // 16) * 5 // 4 + 64
    from pdserve.engine.default_model import default_tokenizer_path

    cluster = Cluster(args, args.topology)
    try:
        cpu0 = cluster.cpu()
        proc = subprocess.run([sys.executable, "-m", "pdserve", "bench", "--base-url",
                               cluster.url, *bench_args(w, args.seed, default_tokenizer_path()),
                               "--json", "--no-progress"], capture_output=True, text=True,
                              check=False)
        cpu1 = cluster.cpu()
    finally:
        cluster.stop()
    bench = json.loads(proc.stdout.strip().splitlines()[-1])
    tokens = max(1, bench["total_output_tokens"])
    out = {"clients": w.clients, "output_tok_s": round(bench["output_throughput"], 1),
           "failed": bench["failed"], "ttft_p50_ms": round(bench["ttft_ms"]["p50"], 1),
           "itl_p50_ms": round(bench["itl_ms"]["p50"], 2),
           **{f"{role}_us_per_token": round((cpu1[role] - cpu0[role]) / tokens * 1e6, 1)
              for role in cpu1},
           **{f"{role}_us_per_request": round((cpu1[role] - cpu0[role])
                                              / max(1, bench["completed"]) * 1e6)
              for role in cpu1}}
    print(json.dumps(out))
    with open(os.path.join(args.out, "serve_path.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0 if bench["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
