"""`pdserve generate`: offline generation over a JSONL file of prompts."""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.engine.model_shapes import add_model_source_args
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tp.ranks import RankError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve generate",
                                description="Generate completions for a JSONL file of prompts.")
    p.add_argument("--prompts", required=True,
                   help="JSONL file, one object per line with a `prompt` field ('-' = stdin)")
    p.add_argument("--model", default=None, help="HF model directory or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    add_model_source_args(p)
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is there), cpu, cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def _read_prompts(path: str) -> list[str | list[int]]:
    fh = sys.stdin if path == "-" else open(path, encoding="utf-8")
    prompts = []
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), (str, list)):
                raise ValueError(f"{path}:{n}: expected an object with a `prompt` field")
            prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from pdserve.engine.llm import LLM

        prompts = _read_prompts(args.prompts)
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        llm = LLM(model=args.model, model_shape=args.model_shape, load_format=args.load_format,
                  device=args.device, dtype=args.dtype,
                  page_size=args.page_size, max_running=args.max_running,
                  chunked_prefill_size=args.chunked_prefill_size, tp=args.tp)
        try:
            outs = llm.generate(prompts, sp, chat=args.chat)
        finally:
            llm.close()
    except (ValueError, OSError, RankError) as e:
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    num_tokens = sum(len(o.token_ids) for o in outs)
    tps = num_tokens / llm.last_generate_s if llm.last_generate_s > 0 else 0.0
    for o in outs:
        if args.json:
            print(json.dumps({"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids}))
        else:
            print(f"--- {o.prompt!r}\n{o.text}")
    summary = {"num_prompts": len(outs), "generated_tokens": num_tokens,
               "generate_s": round(llm.last_generate_s, 4), "tokens_per_s": round(tps, 2),
               "load_s": round(llm.load_s, 3)}
    print(json.dumps(summary) if args.json else
          f"=== {num_tokens} tokens in {summary['generate_s']} s: {tps:.1f} tok/s "
          f"(load {summary['load_s']} s)")
    return 0
