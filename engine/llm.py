"""Offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.attention import cpu_decode
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, build_engine_parts
from pdserve.engine.req import Req
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stop import TextStream
from pdserve.engine.warmup import warm_up

log = logging.getLogger(__name__)


@dataclass
class GenerateOutput:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    num_retractions: int = 0  # times KV pressure sent it back to the waiting queue

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens}


@dataclass
class OfflineReq(Req):
    stream: TextStream | None = None  # applies stop strings and detokenizes


class _OfflineScheduler(Scheduler):
    """Feeds every token to the request's TextStream, which applies stop strings."""

    def on_tokens(self, req: OfflineReq, num_new: int) -> None:
        stream = req.stream
        if stream.finished:
            return
        stream.push_many(req.output_ids[-num_new:])
        if stream.finished and req.finish_reason is None:
            req.finish_reason = stream.finish_reason


class LLM:
    def __init__(self, model: str | None = None, device: str = "auto", dtype: str | None = None,
                 page_size: int = 16, num_pages: int | None = None, max_running: int = 64,
                 chunked_prefill_size: int = 2048, disable_radix_cache: bool = False,
                 attention_backend: str | None = None, max_context_len: int | None = None,
                 cpu_kernels: bool = True, tp: int = 1, load_format: str = "auto",
                 model_shape: str | None = None) -> None:
        """`device` auto: CUDA when a GPU is there, else CPU. `tp`: tensor-parallel ranks
        (processes started here, one device each; on CPU they share this process's torch
        threads); `close()` (or `with LLM(...) as llm:`) stops them. `load_format="dummy"`:
        random weights for `model`'s config; `model_shape`: a named shape
        (engine/model_shapes.py) with random weights and the embedded SmolLM2 tokenizer, instead
        of `model`."""
        cfg = EngineConfig(
            model=model, model_shape=model_shape, load_format=load_format, device=device,
            dtype=dtype, attention_backend=attention_backend,
            disable_radix_cache=disable_radix_cache, cpu_kernels=cpu_kernels, tp_size=tp,
            cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                              max_context_len=max_context_len,
                              max_reqs=max(max_running + 8, 16)),
            scheduler=SchedulerConfig(max_running=max_running,
                                      chunked_prefill_size=chunked_prefill_size))
        parts = build_engine_parts(cfg)
        self._parts = parts
        parts.watch_ranks(lambda message: log.error("%s: generation stops", message))
        if cpu_kernels and parts.runner.device.type == "cpu" \
                and cfg.torch_dtype == torch.float32:
            # Offline runs want throughput from the first batch: wait for the CPU decode
            # kernel (a one-time build per host, then an import from the pdserve cache).
            cpu_decode.load(block=True)
        self.config = cfg
        self.tokenizer = parts.tokenizer
        self.model_config = parts.runner.model_config
        self.memory = parts.memory
        self.load_s = parts.load_s
        self.scheduler = _OfflineScheduler(parts.runner, parts.memory, cfg.scheduler)
        self._ids = itertools.count()
        self.last_generate_s = 0.0

    def set_max_running(self, max_running: int) -> None:
        """Run at most `max_running` requests at once from now on (an offline stand-in for that
        many clients in a closed loop); at most the value the engine was built with, which
        sized its request slots and CUDA graphs."""
        built = self.config.scheduler.max_running
        if not 0 < max_running <= built:
            raise ValueError(f"max_running: must be in [1, {built}], got {max_running}")
        self.scheduler = _OfflineScheduler(
            self.scheduler.runner, self.memory,
            dataclasses.replace(self.config.scheduler, max_running=max_running))

    def warm_up(self) -> dict[str, float]:
        """Run the paths of the first requests once (engine/warmup.py); {path: seconds}."""
        return warm_up(self.scheduler)

    def close(self) -> None:
        """Stops the tensor-parallel ranks, if any (the LLM cannot generate afterwards)."""
        self._parts.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        if chat:
            msgs = [{"role": "user", "content": prompt}]
            out = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                     tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys")
                        else out)
        return list(self.tokenizer.encode(prompt))

    def generate(self, prompts: Sequence[str | list[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False) -> list[GenerateOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} for {len(prompts)} prompts")
        vocab = self.model_config.vocab_size
        eos = tuple(self.model_config.eos_token_ids)
        reqs = []
        for prompt, sp in zip(prompts, sampling_params):
            sp.validate(vocab)
            ids = self.encode(prompt, chat)
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt: token ids must lie in [0, {vocab})")
            if not ids:
                raise ValueError("prompt: must contain at least one token")
            if len(ids) >= self.memory.max_context_len:
                raise ValueError(f"prompt: {len(ids)} tokens leave no room in the context of "
                                 f"{self.memory.max_context_len}")
            req = OfflineReq(f"offline-{next(self._ids)}", ids, sp,
                             stream=TextStream.from_params(self.tokenizer, sp, eos, ids))
            reqs.append(req)
        added = []
        try:
            for req in reqs:
                self.scheduler.add(req)
                added.append(req)
            t0 = time.perf_counter()
            while self.scheduler.has_work:
                self.scheduler.step()
            self.last_generate_s = time.perf_counter() - t0
        finally:
            for req in added:  # an error mid-run must not strand KV pages
                if not req.finished:
                    self.scheduler.abort(req.rid)
        outs = []
        for prompt, req in zip(prompts, reqs):
            stream = req.stream
            stream.finish(req.finish_reason or "abort")
            outs.append(GenerateOutput(
                prompt, stream.text, list(req.output_ids), req.finish_reason or "abort",
                len(req.input_ids), req.cached_tokens, list(req.output_logprobs),
                list(req.output_top_logprobs), req.num_retractions))
        return outs
