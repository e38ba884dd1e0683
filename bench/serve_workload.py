"""`pdserve bench` workloads: random lengths, shared system prompts, multi-turn chats, ShareGPT.

Without a tokenizer, prompts are built from common short English words that byte-level BPE
vocabularies hold as one token each (with their leading space), so N words are ~N tokens; the
true prompt length comes back in each response's usage. With `--tokenizer`, completions prompts
are sent as token ids cut to the exact length.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from typing import Any

from pdserve.bench.serve_config import BenchConfig

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there one all we can has been if more when "
         "will would who so no time out up about into than them only new some could these two "
         "may first then do any like my now over such our man me even most made after also did "
         "many before must through back years where much your way well down should because each "
         "just those people how too little state good very make world still see own men work "
         "long here get both between life being under never day same another know while last "
         "might us great old year off come since against go came right used take three").split()
# Fallback when a ShareGPT reply's length must be guessed from its words.
TOKENS_PER_WORD = 1.3


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: raw text or token ids (completions) or messages (chat)."""

    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    input_len: int  # intended prompt tokens (approximate without a tokenizer)
    output_len: int  # max_tokens, with ignore_eos


class PromptMaker:
    """Random word text, cut to exact token counts when a tokenizer is given."""

    def __init__(self, rng: random.Random, tokenizer: Any | None) -> None:
        self.rng = rng
        self.tokenizer = tokenizer

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def ids(self, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids += self.tokenizer.encode(" " + self.words(n - len(ids) + 8),
                                         add_special_tokens=False)
        return ids[:n]

    def text(self, n: int) -> str:
        return self.tokenizer.decode(self.ids(n)) if self.tokenizer is not None else self.words(n)

    def count(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        return max(1, round(len(text.split()) * TOKENS_PER_WORD))


def load_tokenizer(path: str | None) -> Any | None:
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _length(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def _as_text(messages: list[dict[str, str]]) -> str:
    """Chat turns flattened for the completions endpoint."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def random_requests(cfg: BenchConfig, maker: PromptMaker) -> list[BenchRequest]:
    out = []
    for _ in range(cfg.num_prompts):
        n_in, n_out = _length(maker.rng, cfg.input_len), _length(maker.rng, cfg.output_len)
        if cfg.chat:
            out.append(BenchRequest(None, [{"role": "user", "content": maker.text(n_in)}],
                                    n_in, n_out))
        else:
            prompt = maker.ids(n_in) if maker.tokenizer is not None else maker.words(n_in)
            out.append(BenchRequest(prompt, None, n_in, n_out))
    return out


def shared_prefix_requests(cfg: BenchConfig, maker: PromptMaker) -> list[BenchRequest]:
    """`num_prefixes` system prompts of `prefix_len` tokens, each followed by a unique question."""
    systems = [maker.text(cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    out = []
    for i in range(cfg.num_prompts):
        n_in, n_out = _length(maker.rng, cfg.input_len), _length(maker.rng, cfg.output_len)
        messages = [{"role": "system", "content": systems[i % len(systems)]},
                    {"role": "user", "content": maker.text(n_in)}]
        out.append(_from_messages(cfg, messages, cfg.prefix_len + n_in, n_out))
    return out


def multi_turn_requests(cfg: BenchConfig, maker: PromptMaker) -> list[BenchRequest]:
    """Conversations of `num_turns` turns; turn k resends turns 1..k-1 with synthetic replies.
    All first turns come before all second turns, so a turn's history is usually cached."""
    num_convs = -(-cfg.num_prompts // cfg.num_turns)
    histories = [[{"role": "system", "content": maker.text(cfg.prefix_len)}]
                 for _ in range(num_convs)]
    lengths = [cfg.prefix_len] * num_convs
    out: list[BenchRequest] = []
    for _turn in range(cfg.num_turns):
        for c, history in enumerate(histories):
            if len(out) == cfg.num_prompts:
                return out
            n_in, n_out = _length(maker.rng, cfg.input_len), _length(maker.rng, cfg.output_len)
            history.append({"role": "user", "content": maker.text(n_in)})
            lengths[c] += n_in
            out.append(_from_messages(cfg, list(history), lengths[c], n_out))
            history.append({"role": "assistant", "content": maker.text(n_out)})
            lengths[c] += n_out
    return out


def _from_messages(cfg: BenchConfig, messages: list[dict[str, str]], n_in: int,
                   n_out: int) -> BenchRequest:
    if cfg.chat:
        return BenchRequest(None, messages, n_in, n_out)
    return BenchRequest(_as_text(messages), None, n_in, n_out)


def sharegpt_requests(cfg: BenchConfig, maker: PromptMaker) -> list[BenchRequest]:
    """First human turn as the prompt; the reply that follows sets the output length."""
    with open(cfg.dataset_path or "", encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"dataset_path: {cfg.dataset_path} is not a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(reply, dict)):
            continue
        if first.get("from") not in ("human", "user") or not first.get("value"):
            continue
        pairs.append((str(first["value"]), str(reply.get("value", ""))))
    maker.rng.shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        n_in, n_out = maker.count(prompt), maker.count(reply)
        if n_in < 4 or n_out < 4:
            continue
        if cfg.chat:
            out.append(BenchRequest(None, [{"role": "user", "content": prompt}], n_in, n_out))
        else:
            out.append(BenchRequest(prompt, None, n_in, n_out))
        if len(out) == cfg.num_prompts:
            break
    if not out:
        raise ValueError(f"dataset_path: no usable conversations in {cfg.dataset_path}")
    return out


def build_workload(cfg: BenchConfig, warmup: int = 0) -> list[BenchRequest]:
    """`warmup` extra requests first (same generator), then the measured ones."""
    maker = PromptMaker(random.Random(cfg.seed), load_tokenizer(cfg.tokenizer))
    build = {"random": random_requests, "shared-prefix": shared_prefix_requests,
             "multi-turn": multi_turn_requests, "sharegpt": sharegpt_requests}[cfg.dataset]
    warm = random_requests(_with_prompts(cfg, warmup), maker) if warmup else []
    return warm + build(cfg, maker)


def _with_prompts(cfg: BenchConfig, n: int) -> BenchConfig:
    """Warm-up requests: random prompts, at most 8 output tokens (they only warm the path)."""
    short = min(cfg.output_len[0], 8)
    return replace(cfg, num_prompts=n, dataset="random", dataset_path=None,
                   output_len=(short, short))
