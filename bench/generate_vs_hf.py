#!/usr/bin/env python3
"""pdserve's offline engine vs HF transformers' batched `generate`, same prompts, same run.

Greedy, ignore_eos, each request with its own output length drawn from `--output-len LO:HI`
(as in real traffic). HF's batched generate has one max_new_tokens per batch, so it runs every
row to the batch's longest request and each row is cut to its own length afterwards; pdserve
retires a request when it is done and admits the next (continuous batching). Both count the
same useful tokens (the sum of the requested lengths). Prints tokens/s of each (generation
only; loading excluded), the ratio, and how many outputs match token for token.

    python -m pdserve.bench.generate_vs_hf [--num-prompts 32] [--output-len 8:128] [--model PATH]
        [--repeats 3] [--no-cpu-kernels]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import time

import torch


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ("the a model server page cache token decode prefill request batch memory fast "
             "paris france river city history science music garden ocean").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 120))) for _ in range(n)]


@functools.lru_cache(maxsize=1)
def load_hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = (os.path.dirname(path), os.path.basename(path)) if path.endswith(".gguf") else \
        (path, None)
    kw = {"gguf_file": f} if f else {}
    tok = AutoTokenizer.from_pretrained(d, **kw)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, **kw).eval()
    return model, tok


def run_hf(path: str, prompts: list[str], lens: list[int], batch_size: int
           ) -> tuple[float, list]:
    model, tok = load_hf(path)
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True)
        n = max(lens[i:i + batch_size])
        with torch.inference_mode():
            gen = model.generate(**enc, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        rows = gen[:, enc.input_ids.shape[1]:].tolist()
        outs += [row[:k] for row, k in zip(rows, lens[i:i + batch_size])]
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", default="8:128", help="N or LO:HI (uniform, seeded)")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3,
                    help="alternate pdserve and HF this many times; the best time of each counts")
    ap.add_argument("--no-cpu-kernels", action="store_true",
                    help="pdserve on plain torch ops only (no packed linears, no C++ attention)")
    args = ap.parse_args()
    from pdserve.engine.default_model import default_model_path
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    path = args.model or default_model_path()
    prompts = make_prompts(args.num_prompts)
    lo, _, hi = args.output_len.partition(":")
    rng = random.Random(1)
    lens = [rng.randint(int(lo), int(hi or lo)) for _ in prompts]
    llm = LLM(model=path, device="cpu", max_running=args.num_prompts,
              cpu_kernels=not args.no_cpu_kernels)
    sp = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    ours_s = hf_s = float("inf")
    for _ in range(args.repeats):  # alternating, so load from elsewhere hits both alike
        ours = llm.generate(prompts, sp)
        ours_s = min(ours_s, llm.last_generate_s)
        t, hf_out = run_hf(path, prompts, lens, args.hf_batch_size)
        hf_s = min(hf_s, t)
    n_tok = sum(lens)
    same = sum(o.token_ids == h for o, h in zip(ours, hf_out))
    row = {"prompts": args.num_prompts, "output_len": args.output_len, "tokens": n_tok,
           "threads": torch.get_num_threads(), "cpu_kernels": not args.no_cpu_kernels,
           "load_avg_1m": round(os.getloadavg()[0], 2),  # > threads: shared, ratio is noisy
           "pdserve_tok_s": round(n_tok / ours_s, 1),
           "hf_tok_s": round(n_tok / hf_s, 1), "ratio": round(hf_s / ours_s, 2),
           "identical_outputs": f"{same}/{len(prompts)}"}
    print(json.dumps(row))
    print(f"pdserve {row['pdserve_tok_s']} tok/s vs HF generate {row['hf_tok_s']} tok/s: "
          f"{row['ratio']}x ({same}/{len(prompts)} outputs identical)")


if __name__ == "__main__":
    main()
