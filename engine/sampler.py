"""Batched token sampling over logits [B, V].

`SamplingBatch.build` turns per-request `SamplingParams` into device tensors once per batch;
`Sampler.sample` then runs without host synchronisation (no `.item()` / `.tolist()`): every
stage is a masked tensor op over the whole batch, and stages no row needs are skipped by Python
flags fixed at build time.

Order: penalties -> min_tokens mask -> (greedy argmax) -> temperature -> top-k -> top-p ->
min-p -> sample. Greedy rows take `torch.argmax` of the penalized logits, bit-identical to HF.

Seeded rows draw exponential noise from a generator seeded with `mix(seed, step)`, where step is
the request's output position, and pick `argmax(p / noise)` (an exponential race, which samples
from `p`). The draw therefore depends only on (seed, step, vocab size, device type): prefill
sampling token 0 and decode sampling the rest reproduce one process doing all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.device import to_device

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step) -> a 63-bit generator seed; pure function of its inputs."""
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, raw-logit log_softmax of the chosen token
    top_logprob_ids: torch.Tensor | None  # [B, k] int64, k = max requested over the batch
    top_logprobs: torch.Tensor | None  # [B, k] float32


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] int32 occurrence counts; padding goes to a spare column V that is dropped."""
    ids = _padded(rows, vocab_size, device)
    counts = torch.zeros((len(rows), vocab_size + 1), dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size].contiguous()


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one batch. Mutable only through `advance`."""

    vocab_size: int
    temperatures: torch.Tensor  # [B] float32; greedy rows hold 1.0
    greedy: torch.Tensor  # [B] bool
    top_ks: torch.Tensor  # [B] int64 in [1, V]; V = off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    min_tokens: torch.Tensor  # [B] int64
    output_lens: torch.Tensor  # [B] int64
    prompt_mask: torch.Tensor | None  # [B, V] bool, only when a row has a repetition penalty
    output_counts: torch.Tensor | None  # [B, V] int32, only when a row has any penalty
    stop_mask: torch.Tensor | None  # [B, V] bool: eos + stop ids, only when min_tokens is used
    seeds: list[int | None]  # host-side; the generator seed is mix_seed(seed, steps[i])
    steps: list[int]  # host-side output position of the token about to be sampled
    max_logprobs: int  # max requested top-k (0: chosen only); -1: no row wants logprobs
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], output_ids: list[list[int]],
              prompt_ids: list[list[int]] | None, vocab_size: int,
              device: torch.device | str = "cpu",
              eos_token_ids: tuple[int, ...] = ()) -> SamplingBatch:
        """Tensors for sampling the next token of each row (row i has `output_ids[i]` so far)."""
        if len(output_ids) != len(params):
            raise ValueError(f"output_ids: {len(output_ids)} rows for {len(params)} params")
        if prompt_ids is not None and len(prompt_ids) != len(params):
            raise ValueError(f"prompt_ids: {len(prompt_ids)} rows for {len(params)} params")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        device = torch.device(device)

        greedy = [p.greedy for p in params]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        prompt_mask = None
        if use_rep:
            prompts = prompt_ids if prompt_ids is not None else [[] for _ in params]
            prompt_mask = _token_counts(prompts, vocab_size, device) > 0
        output_counts = _token_counts(output_ids, vocab_size, device) if (
            use_rep or use_freq) else None
        stop_mask = None
        if any(p.min_tokens > 0 for p in params):
            rows = [list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
                    for p in params]
            stop_mask = _token_counts(rows, vocab_size, device) > 0
        logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
        # Two uploads (one per dtype) instead of one per field: each costs host time per step.
        floats = to_device(torch.tensor(
            [[1.0 if g else p.temperature for g, p in zip(greedy, params)],
             [p.top_p for p in params], [p.min_p for p in params],
             [p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
             [p.presence_penalty for p in params], [float(g) for g in greedy]],
            dtype=torch.float32).reshape(7, len(params)), device)
        ints = to_device(torch.tensor(
            [top_ks, [p.min_tokens for p in params], [len(o) for o in output_ids]],
            dtype=torch.int64).reshape(3, len(params)), device)
        return cls(
            vocab_size=vocab_size,
            temperatures=floats[0],
            greedy=floats[6] > 0.5,
            top_ks=ints[0],
            top_ps=floats[1],
            min_ps=floats[2],
            repetition_penalties=floats[3],
            frequency_penalties=floats[4],
            presence_penalties=floats[5],
            min_tokens=ints[1],
            output_lens=ints[2],
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            stop_mask=stop_mask,
            seeds=[p.seed for p in params],
            steps=[len(o) for o in output_ids],
            max_logprobs=max(logprob_ks, default=-1),
            all_greedy=all(greedy),
            use_top_k=any(not g and k < vocab_size for g, k in zip(greedy, top_ks)),
            use_top_p=any(not p.greedy and p.top_p < 1.0 for p in params),
            use_min_p=any(not p.greedy and p.min_p > 0.0 for p in params),
        )

    def advance(self, next_token_ids: torch.Tensor) -> None:
        """Account the tokens just sampled, for reuse on the next step of the same rows."""
        ids = next_token_ids.to(self.output_lens.device, torch.int64)
        if self.output_counts is not None:
            self.output_counts.scatter_add_(
                1, ids[:, None], torch.ones_like(ids[:, None], dtype=torch.int32))
        self.output_lens += 1
        self.steps = [s + 1 for s in self.steps]


class Sampler:
    """Stateless: all per-request state lives in `SamplingBatch`."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[1] != batch.vocab_size:
            raise ValueError(f"logits: expected [B, {batch.vocab_size}], got {tuple(logits.shape)}")
        raw = logits.float()  # a copy for bf16; never mutate the caller's tensor below
        x = apply_penalties(raw, batch)
        if batch.stop_mask is not None:
            below = (batch.output_lens < batch.min_tokens)[:, None]
            x = x.masked_fill(batch.stop_mask & below, float("-inf"))
        next_ids = torch.argmax(x, dim=-1)
        if not batch.all_greedy:
            sampled = self._sample_random(x, batch)
            next_ids = torch.where(batch.greedy, next_ids, sampled)
        return self._logprobs(raw, next_ids, batch)

    def _sample_random(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        x = x / batch.temperatures[:, None]
        if batch.use_top_k or batch.use_top_p:
            x = apply_top_k_top_p(x, batch.top_ks if batch.use_top_k else None,
                                  batch.top_ps if batch.use_top_p else None)
        probs = torch.softmax(x, dim=-1)
        if batch.use_min_p:
            max_p = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < batch.min_ps[:, None] * max_p, 0.0)
        noise = torch.empty_like(probs).exponential_()
        for i, seed in enumerate(batch.seeds):
            if seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(mix_seed(seed, batch.steps[i]))
                noise[i] = torch.empty(probs.shape[1], device=probs.device).exponential_(
                    generator=gen)
        # p / E with E ~ Exp(1) iid: the argmax is distributed as p. Masked tokens have p = 0
        # and can never win against a kept token (p > 0); E is clamped away from 0.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return torch.argmax(probs / noise, dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor, next_ids: torch.Tensor,
                  batch: SamplingBatch) -> SampleOutput:
        if batch.max_logprobs < 0:
            return SampleOutput(next_ids, None, None, None)
        logp = torch.log_softmax(raw, dim=-1)
        chosen = logp.gather(1, next_ids[:, None]).squeeze(1)
        if batch.max_logprobs == 0:
            return SampleOutput(next_ids, chosen, None, None)
        top = torch.topk(logp, batch.max_logprobs, dim=-1)
        return SampleOutput(next_ids, chosen, top.indices, top.values)


def apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (HF/vLLM: prompt + output tokens), then frequency/presence (OpenAI: output)."""
    counts = batch.output_counts
    if counts is None:
        return x
    if batch.prompt_mask is not None:
        seen = batch.prompt_mask | (counts > 0)
        rp = batch.repetition_penalties[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    freq = counts.to(x.dtype) * batch.frequency_penalties[:, None]
    pres = (counts > 0).to(x.dtype) * batch.presence_penalties[:, None]
    return x - freq - pres


def apply_top_k_top_p(x: torch.Tensor, top_ks: torch.Tensor | None,
                      top_ps: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k and top-p nucleus; keeps >= 1 token per row.

    Top-k keeps every token tied with the k-th largest logit. Top-p keeps the smallest
    high-probability set whose mass reaches p (computed after top-k).
    """
    sorted_x, order = x.sort(dim=-1, descending=False)
    vocab = x.shape[1]
    if top_ks is not None:
        kth = sorted_x.gather(1, (vocab - top_ks)[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if top_ps is not None:
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_ps)[:, None]
        drop[:, -1] = False  # the most likely token always survives
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)
