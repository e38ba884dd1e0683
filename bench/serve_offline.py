"""The offline engine's side of `scripts/serve-bench`: the workloads the served runs get, through
`LLM.generate` in this process (its own, so that its GPU memory is gone before a cluster
starts); one JSON object out.

- one client (`clients == 1`): per prompt, TTFT is a `max_tokens=1` generation (prefill and
  the first token) and ITL (a full generation - that) / (output tokens - 1), medians over the
  prompts (distinct ones for the two, so that no prompt is served from the radix cache);
- several clients: every prompt at once with at most `clients` running (a closed loop of that
  many clients without their round trips); output tokens / generation time.
The weights roofline: weight bytes over the device's copy bandwidth (bytes read + written)
measured here, the floor of a decode step at batch 1.

    python -m pdserve.bench.serve_offline --model-shape llama3-8b --out offline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from pdserve.bench.serve_compare import (
    Workload,
    add_workload_args,
    prompts,
    workload_seed,
    workloads_of,
)
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device (or host) copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def one_client(llm: LLM, w: Workload, seed: int) -> dict:
    full, first = prompts(w, seed), prompts(w, seed + 1)
    ttft, itl = [], []
    for p, q in zip(full, first):
        t0 = time.perf_counter()
        llm.generate([q], _greedy(1))
        ttft.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = llm.generate([p], _greedy(w.output_len))[0]
        total = time.perf_counter() - t0
        itl.append((total - ttft[-1]) / max(1, len(out.token_ids) - 1))
    return {"ttft_ms": statistics.median(ttft) * 1e3, "itl_ms": statistics.median(itl) * 1e3,
            "requests": len(full)}


def many_clients(llm: LLM, w: Workload, seed: int) -> dict:
    llm.set_max_running(w.clients)
    outs = llm.generate(prompts(w, seed), _greedy(w.output_len))
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tok_s": tokens / llm.last_generate_s, "duration_s": llm.last_generate_s,
            "output_tokens": tokens, "requests": len(outs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.serve_offline",
                                description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    loads = workloads_of(args)
    t0 = time.perf_counter()
    llm = LLM(model_shape=args.model_shape, device=args.device, num_pages=args.num_pages,
              max_running=max(w.clients for w in loads))
    load_s = time.perf_counter() - t0
    device = llm.scheduler.runner.device
    warm = llm.warm_up()
    llm.generate([prompts(loads[0], args.seed + 5)[0]], _greedy(2))  # the longest prefill
    weight_bytes = sum(t.numel() * t.element_size() for t in
                       {id(q): q for q in llm.scheduler.runner.model.parameters()}.values())
    bw = copy_bandwidth(device)
    result = {"model_shape": args.model_shape, "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
              "load_s": load_s, "warmup_s": sum(warm.values()),
              "weights_gb": weight_bytes / 1e9, "copy_gb_s": bw / 1e9,
              "roofline_ms": weight_bytes / bw * 1e3, "workloads": {}}
    for i, w in enumerate(loads):
        run = one_client if w.clients == 1 else many_clients
        t_start = time.time()
        result["workloads"][w.name] = run(llm, w, workload_seed(args.seed, i))
        # Wall-clock edges, for the step traces (bench/step_trace.py).
        result["workloads"][w.name].update(t_start=t_start, t_end=time.time())
        print(f"offline {w.name}: {json.dumps(result['workloads'][w.name])}", flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
