"""Overlap scheduling for decode: step N+1 is prepared and launched before step N's tokens are
read back, so the CPU work of a step (slot allocation, batch tensors, attention planning, graph
launch) runs while the GPU is still busy with the previous one.

Step N's sampled ids stay on the device and feed step N+1 directly (the host holds a `PENDING`
placeholder at their position in `output_ids`, so lengths, positions and slots are all as if the
token were known). Their host copy is started asynchronously and read one step later, when the
tokens are streamed and finish conditions checked. Consequences, all handled here:
- a request that stops on EOS / a stop id has already been launched in the next step; that
  token is dropped and its KV released only once that step has completed;
- a request that will end by length (max_tokens, context) is known on the host and is not
  launched again;
- anything that needs the real tokens or frees KV of running requests (retraction, abort,
  penalties and logprobs, which read the history) first drains the step in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.engine.req import Req
from pdserve.engine.schedule_batch import ScheduleBatch
from pdserve.kernels.device import to_device

PENDING = -1  # output_ids placeholder for a token sampled on the device, not yet read back


def simple_sampling(req: Req) -> bool:
    """Sampling that needs no host-side history of output tokens (penalties, logprobs do)."""
    sp = req.sampling
    return (sp.repetition_penalty == 1.0 and sp.frequency_penalty == 0.0
            and sp.presence_penalty == 0.0 and sp.logprobs is None)


@dataclass
class InFlight:
    reqs: list[Req]
    slots: list[int]  # index of each request's PENDING entry in its output_ids
    next_ids: torch.Tensor  # [B] on the device: the input of the following step
    host_ids: torch.Tensor  # [B] host copy, valid once `done` has completed
    done: torch.cuda.Event | None
    rows: dict[int, int] = field(default_factory=dict)  # id(req) -> row


class OverlapDecoder:
    """Launches decode steps one ahead of reading their results back (see module doc)."""

    def __init__(self, sched) -> None:  # noqa: ANN001 - the Scheduler that owns it
        self.sched = sched
        self.inflight: InFlight | None = None
        self.deferred: list[Req] = []  # finished, but still in the step in flight

    @property
    def busy(self) -> bool:
        return self.inflight is not None or bool(self.deferred)

    def will_end_by_length(self, req: Req) -> bool:
        return (len(req.output_ids) >= req.sampling.max_tokens
                or req.seq_len >= self.sched.memory.max_context_len)

    def step(self, reqs: list[Req]) -> bool:
        """Allocates, launches `reqs` and then reads back the previous step. False (nothing
        launched) when their KV slots don't fit: the caller drains and retracts."""
        s = self.sched
        if reqs and not s.memory.alloc_decode(reqs):
            return False
        prev = self.inflight
        self.inflight = self._launch(reqs, prev) if reqs else None
        if prev is not None:
            self._collect(prev)
        return True

    def drain(self) -> None:
        """Read back everything in flight and release what finished; after this the host state
        of every request is exact (no PENDING)."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self._collect(prev)
        self._release_deferred()

    # ---- internals -----------------------------------------------------------------------

    def _launch(self, reqs: list[Req], prev: InFlight | None) -> InFlight:
        s = self.sched
        device = s.runner.device
        dst, src = [], []
        for i, r in enumerate(reqs):
            if r.output_ids and r.output_ids[-1] == PENDING:
                assert prev is not None
                dst.append(i)
                src.append(prev.rows[id(r)])
        fix: Callable[[ForwardBatch], None] | None = None
        if dst:
            dst_t = to_device(torch.tensor(dst), device)
            src_t = to_device(torch.tensor(src), device)

            def fix(fb: ForwardBatch) -> None:
                fb.input_ids.index_copy_(0, dst_t, prev.next_ids.index_select(0, src_t))

        logits = s.runner.forward(ScheduleBatch(ForwardMode.DECODE, reqs), s.memory,
                                  fix_inputs=fix)
        next_ids = s.runner.sample(logits, reqs).next_token_ids
        done = None
        if next_ids.is_cuda:
            host = torch.empty(next_ids.shape, dtype=next_ids.dtype, pin_memory=True)
            host.copy_(next_ids, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = next_ids
        slots = []
        for r in reqs:
            r.kv_len += 1  # this step wrote the KV of the token it consumed
            r.output_ids.append(PENDING)
            slots.append(len(r.output_ids) - 1)
        return InFlight(reqs, slots, next_ids, host, done, {id(r): i for i, r in enumerate(reqs)})

    def _collect(self, f: InFlight) -> None:
        s = self.sched
        if f.done is not None:
            f.done.synchronize()
        ids = f.host_ids.tolist()
        now = time.perf_counter()
        newer = self.inflight.rows if self.inflight is not None else {}
        for r, slot, tok in zip(f.reqs, f.slots, ids):
            if r.finished:
                continue  # stopped at an earlier token: this one was computed in vain
            r.output_ids[slot] = tok
            # Finish checks and streaming see the request as of this token: without the
            # placeholder of a step launched after it.
            later = r.output_ids[slot + 1:]
            del r.output_ids[slot + 1:]
            s.token_done(r, tok, now)
            if r.finished:  # tokens launched after this one are dropped; KV is kept until
                r.kv_len = min(r.kv_len, r.seq_len)  # the step computing them is done
            else:
                r.output_ids.extend(later)
        self._release_deferred()
        running = {id(r) for r in s.running}
        ended = [r for r in f.reqs if r.finished and id(r) in running]
        if ended:
            s.running = [r for r in s.running if not r.finished]
        for r in ended:
            (self.deferred.append(r) if id(r) in newer else s.finish(r))

    def _release_deferred(self) -> None:
        """Finish requests whose last launched step has completed (it is no longer in flight)."""
        if not self.deferred:
            return
        live = self.inflight.rows if self.inflight is not None else {}
        keep = []
        for r in self.deferred:
            (keep.append(r) if id(r) in live else self.sched.finish(r))
        self.deferred = keep
