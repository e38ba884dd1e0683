"""The continuous-batching scheduler shared by the offline engine, prefill and decode workers.

One iteration (`step`) runs either an extend batch (new or chunked prompts, prefill first) or a
decode step over the running requests. Requests join between decode steps. When KV runs out
during decode, the newest request is retracted: its KV goes to the radix cache, it returns to
the front of the waiting queue and is recomputed later with its generated tokens kept.

Roles customize two hooks: `on_prefill_done(req)` (default: start decoding) and
`on_finish(req)` (default: release its KV), plus `on_tokens(req, ...)` to stream.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from pdserve.engine import req_trace
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.forward_batch import ForwardMode
from pdserve.engine.kernel_profile import KernelProfile
from pdserve.engine.memory import KVMemory
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.overlap import OverlapDecoder, simple_sampling
from pdserve.engine.req import Req
from pdserve.engine.schedule_batch import ExtendEntry, ScheduleBatch
from pdserve.engine.step_trace import StepTrace


class Scheduler:
    def __init__(self, runner: ModelRunner, memory: KVMemory, config: SchedulerConfig) -> None:
        self.runner = runner
        self.memory = memory
        self.config = config
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # a prompt part-way through chunked prefill
        self.eos_ids = tuple(runner.model_config.eos_token_ids)
        self.overlap = (OverlapDecoder(self)
                        if config.overlap_schedule and runner.device.type == "cuda" else None)
        self.trace = StepTrace.from_env()
        self.kernels = KernelProfile.from_env(runner.device)
        self._traced_waiting: set[str] = set()  # PDSERVE_REQ_TRACE: stamped `step` already

    # ---- hooks --------------------------------------------------------------------------------

    def on_prefill_done(self, req: Req) -> None:
        """The prompt is fully in KV and the first token sampled (or the request finished)."""
        if req.finished:
            self.finish(req)
        else:
            self.running.append(req)

    def on_tokens(self, req: Req, num_new: int) -> None:
        """`num_new` tokens were appended to req.output_ids (streaming hook)."""

    def on_finish(self, req: Req) -> None:
        """Called once per request after its KV was released."""

    # ---- queue management -----------------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queue a request. The caller validated it (a non-empty prompt that leaves room in the
        context, sampling parameters in range): the scheduler trusts its caller."""
        self.waiting.append(req)

    def abort(self, rid: str, reason: str = "abort") -> Req | None:
        """Remove a request wherever it is; its KV is released. Returns it if found."""
        self._traced_waiting.discard(rid)
        if self.overlap is not None:
            self.overlap.drain()  # its KV may be in use by the step in flight
        for q in (self.waiting, self.running):
            for r in list(q):
                if r.rid == rid:
                    q.remove(r)
                    r.finish_reason = reason
                    self.finish(r)
                    return r
        if self.chunked is not None and self.chunked.rid == rid:
            r, self.chunked = self.chunked, None
            r.finish_reason = reason
            self.finish(r)
            return r
        return None

    def finish(self, req: Req) -> None:
        self.memory.release(req)
        self.on_finish(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked
                    or (self.overlap is not None and self.overlap.busy))

    # ---- one iteration ------------------------------------------------------------------------

    def step(self) -> ForwardMode:
        trace = self.trace
        if trace is not None:
            wall, t0, num_running = time.time(), time.perf_counter(), len(self.running)
        if req_trace.enabled():  # once per request: the first iteration that finds it waiting
            for r in self.waiting:
                if r.rid not in self._traced_waiting:
                    self._traced_waiting.add(r.rid)
                    req_trace.stamp("step", r.rid)
        batch = self.schedule_extend()
        if batch is not None:
            if req_trace.enabled():
                for e in batch.entries:
                    self._traced_waiting.discard(e.req.rid)
                    req_trace.stamp("scheduled", e.req.rid)
            if self.kernels is None:
                self.run_extend(batch)
            else:
                with self.kernels.step(sum(e.num_tokens for e in batch.entries)):
                    self.run_extend(batch)
            mode = ForwardMode.EXTEND
        elif self.running or (self.overlap is not None and self.overlap.busy):
            self.run_decode()
            mode = ForwardMode.DECODE
        else:
            return ForwardMode.IDLE
        if trace is not None:  # an extend batch's tokens, a decode step's requests
            n = (sum(e.num_tokens for e in batch.entries) if batch is not None
                 else num_running)
            trace.record(wall, time.perf_counter() - t0, mode.name.lower(), n,
                         len(self.running), len(self.waiting))
        return mode

    def schedule_extend(self) -> ScheduleBatch | None:
        budget = self.config.chunked_prefill_size
        entries: list[ExtendEntry] = []
        reserve = self.config.decode_reserve_tokens * len(self.running)
        while budget > 0 and (self.chunked is not None or self.waiting):
            req = self.chunked if self.chunked is not None else self.waiting[0]
            if req is not self.chunked and (
                    len(self.running) + len(entries) >= self.config.max_running):
                break
            fresh = req.req_pool_idx is None
            if fresh and not self.memory.admit(req):
                break
            n = min(req.extend_remaining(), budget)
            if not self.memory.ensure_free_tokens(n + reserve) or \
                    not self.memory.alloc_extend(req, n):
                if fresh:
                    self.memory.release(req)
                break
            if req is self.chunked:
                self.chunked = None
            else:
                self.waiting.popleft()
            entries.append(ExtendEntry(req, req.kv_len, n))
            budget -= n
            if n < req.extend_remaining():
                self.chunked = req
                break
        if not entries:
            return None
        return ScheduleBatch(ForwardMode.EXTEND, [e.req for e in entries], entries)

    def run_extend(self, batch: ScheduleBatch) -> None:
        if req_trace.enabled():
            for e in batch.entries:
                req_trace.stamp("extend", e.req.rid)
        t0 = time.perf_counter()
        logits = self.runner.forward(batch, self.memory)
        done = [i for i, e in enumerate(batch.entries) if e.completes]
        for e in batch.entries:
            e.req.kv_len = e.start + e.num_tokens
        dt = time.perf_counter() - t0
        for e in batch.entries:
            e.req.prefill_s += dt
        if not done:
            return
        reqs = [batch.entries[i].req for i in done]
        self._sample_and_append(reqs, logits[done])
        # The tokens are on the host now, so the forward has run: a prompt's prefill time
        # counts the device's work, not only the host's launches (asynchronous on CUDA).
        synced = time.perf_counter() - t0 - dt
        for r in reqs:
            r.prefill_s += synced
            r.kv_len = r.seq_len - 1  # the sampled token has no KV yet
            self.on_prefill_done(r)

    def run_decode(self) -> None:
        ov = self.overlap
        if ov is not None:
            if all(simple_sampling(r) for r in self.running):
                launch = [r for r in self.running if not ov.will_end_by_length(r)]
                if ov.step(launch):
                    return
            ov.drain()  # retraction, penalties and logprobs need the exact host state
        reqs = self._reserve_decode_slots()
        if not reqs:
            return
        batch = ScheduleBatch(ForwardMode.DECODE, reqs)
        logits = self.runner.forward(batch, self.memory)
        for r in reqs:
            r.kv_len += 1
        self._sample_and_append(reqs, logits)
        for r in reqs:
            r.kv_len = r.seq_len - 1
        still = []
        for r in self.running:
            (self.finish(r) if r.finished else still.append(r))
        self.running = still

    def _reserve_decode_slots(self) -> list[Req]:
        """Allocate this step's slots, retracting the newest requests while KV is short."""
        while self.running and not self.memory.alloc_decode(self.running):
            victim = self.running.pop()
            self.memory.release(victim)
            victim.num_retractions += 1
            self.waiting.appendleft(victim)
        return list(self.running)

    # ---- sampling -----------------------------------------------------------------------------

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        out = self.runner.sample(logits, reqs)
        ids = out.next_token_ids.tolist()
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        now = time.perf_counter()
        if req_trace.enabled():  # before any token is streamed
            for r in reqs:
                if r.first_token_time is None:
                    req_trace.stamp("sampled", r.rid)
        for i, r in enumerate(reqs):
            tok = ids[i]
            r.output_ids.append(tok)
            if lps is not None and r.sampling.logprobs is not None:
                r.output_logprobs.append(lps[i])
                if top_ids is not None and r.sampling.logprobs:
                    k = r.sampling.logprobs
                    r.output_top_logprobs.append((top_ids[i][:k], top_lps[i][:k]))
            self.token_done(r, tok, now)

    def token_done(self, req: Req, tok: int, now: float) -> None:
        """`tok` is the last of req.output_ids: time it, check finish rules, stream it."""
        if req.first_token_time is None:
            req.first_token_time = now
        self._check_finish(req, tok)
        self.on_tokens(req, 1)

    def _check_finish(self, req: Req, tok: int) -> None:
        sp = req.sampling
        n_out = len(req.output_ids)
        if n_out >= sp.min_tokens:
            if (not sp.ignore_eos and tok in self.eos_ids) or tok in sp.stop_token_ids:
                req.finish_reason = "stop"
                return
        if n_out >= sp.max_tokens or req.seq_len >= self.memory.max_context_len:
            req.finish_reason = "length"
