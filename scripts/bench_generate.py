#!/usr/bin/env python3
"""pdserve's offline engine vs HF transformers' batched `generate`, same prompts, same run.

Greedy, fixed output length (ignore_eos) so both produce the same number of tokens. Prints
tokens/s of each (generation only; loading excluded) and the ratio, plus how many outputs match
token for token.

    python scripts/bench_generate.py [--num-prompts 32] [--max-tokens 64] [--model PATH]
"""

from __future__ import annotations

import argparse
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


def run_hf(path: str, prompts: list[str], max_tokens: int, batch_size: int) -> tuple[float, list]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = (os.path.dirname(path), os.path.basename(path)) if path.endswith(".gguf") else \
        (path, None)
    kw = {"gguf_file": f} if f else {}
    tok = AutoTokenizer.from_pretrained(d, **kw)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, **kw).eval()
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True)
        with torch.inference_mode():
            gen = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        outs += gen[:, enc.input_ids.shape[1]:].tolist()
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    args = ap.parse_args()
    from pdserve.engine.default_model import default_model_path
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    path = args.model or default_model_path()
    prompts = make_prompts(args.num_prompts)
    llm = LLM(model=path, max_running=args.num_prompts)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    ours = llm.generate(prompts, sp)
    ours_s = llm.last_generate_s
    hf_s, hf_out = run_hf(path, prompts, args.max_tokens, args.hf_batch_size)
    n_tok = args.num_prompts * args.max_tokens
    same = sum(o.token_ids == h for o, h in zip(ours, hf_out))
    row = {"prompts": args.num_prompts, "max_tokens": args.max_tokens,
           "threads": torch.get_num_threads(), "pdserve_tok_s": round(n_tok / ours_s, 1),
           "hf_tok_s": round(n_tok / hf_s, 1), "ratio": round(hf_s / ours_s, 2),
           "identical_outputs": f"{same}/{len(prompts)}"}
    print(json.dumps(row))
    print(f"pdserve {row['pdserve_tok_s']} tok/s vs HF generate {row['hf_tok_s']} tok/s: "
          f"{row['ratio']}x ({same}/{len(prompts)} outputs identical)")


if __name__ == "__main__":
    main()
