"""Decode scheduler: prealloc queue -> transfer queue -> running batch (+ local prefill).

A request with a bootstrap address first waits in the prealloc queue until pages for its whole
prompt fit (free pages minus a reserve for the running requests' growth, and none while
retracted requests wait to be recomputed) and fewer than `max_running` requests are running or
in transfer: the KV pages gate admission, max_running is a ceiling on top. It then registers
those pages with the prefill worker and waits in the transfer queue. Its KV receiver exists
from arrival, so while it waits for capacity, decode's heartbeats name its room to prefill as
queued here: neither side's bootstrap deadline runs, only the request's own. On Success it
becomes a running request directly from the pages and the aux data (first token): no forward
pass. A request without a bootstrap address is prefilled here (mixed role / short prompts).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.engine import req_trace
from pdserve.engine.req import Req
from pdserve.engine.scheduler import Scheduler
from pdserve.kvtransfer.aux import AuxData
from pdserve.kvtransfer.poll import KVPoll
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.worker.events import (
    ErrorEvent,
    EventSink,
    FinishEvent,
    StageTimes,
    TokenOutput,
    TokensEvent,
)


@dataclass
class DecodeReq(Req):
    """A request on the decode (or mixed) worker: its room and prefill's bootstrap address
    (empty: prefill here), where its events go, and its KV receiver."""

    room: int = 0
    bootstrap_addr: str = ""
    sink: EventSink | None = None
    receiver: KVReceiver | None = None
    t_prealloc: float = 0.0
    t_transferred: float = 0.0
    last_tokens: TokenOutput = TokenOutput()  # not streamed yet at the finish: sent with it
    num_streamed: int = 0  # output tokens put into the sink so far


class DecodeScheduler(Scheduler):
    def __init__(self, *args, kv_manager=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv = kv_manager
        self.prealloc: deque[DecodeReq] = deque()
        self.transfer: list[DecodeReq] = []
        self._first: EventSink | None = None  # a sink given a request's first message this step

    def add(self, req: DecodeReq) -> None:
        if not req.bootstrap_addr:
            super().add(req)
        elif self.kv is None:
            raise ValueError("bootstrap_addr: this worker has no KV transfer (mixed role)")
        else:
            req.receiver = self.kv.create_receiver(req.room, req.bootstrap_addr)
            self.prealloc.append(req)

    @property
    def has_work(self) -> bool:
        return bool(super().has_work or self.prealloc or self.transfer)

    def abort(self, rid: str, reason: str = "abort") -> Req | None:
        for q in (self.prealloc, self.transfer):
            for r in list(q):
                if r.rid == rid:
                    q.remove(r)
                    if r.receiver is not None:
                        r.receiver.abort(reason)
                    self._discard(r, reason)
                    return r
        return super().abort(rid, reason)

    # ---- hooks: streaming --------------------------------------------------------------------

    def stream_interval(self) -> int:
        """Tokens per message of a running request: the configured interval, or more when so
        many requests run that one message each per step would be too many."""
        cfg = self.config
        return max(cfg.stream_interval, -(-len(self.running) // cfg.stream_messages_per_step))

    def on_tokens(self, req: DecodeReq, num_new: int) -> None:
        unsent = len(req.output_ids) - req.num_streamed
        if req.finished:
            req.last_tokens = TokenOutput.last_of(req, unsent)
        elif req.num_streamed == 0 or unsent >= self.stream_interval():
            if req.num_streamed == 0:
                self._first = req.sink
            req.sink.put(TokensEvent(TokenOutput.last_of(req, unsent)))
            req.num_streamed += unsent

    def on_finish(self, req: DecodeReq) -> None:
        now = time.perf_counter()
        ms = 1000.0
        first = req.first_token_time or now
        start = req.t_transferred or first
        timings = StageTimes(
            ttft_ms=(first - req.arrival_time) * ms,
            transfer_ms=(req.t_transferred - req.t_prealloc) * ms if req.t_transferred else 0.0,
            prefill_ms=req.prefill_s * ms,
            decode_ms=(now - start) * ms)
        if req.num_streamed == 0:  # its first tokens come with the finish
            self._first = req.sink
        req.sink.put(FinishEvent(req.finish_reason or "abort", req.last_tokens,
                                 len(req.input_ids), len(req.output_ids), req.cached_tokens,
                                 timings))

    # ---- one iteration -----------------------------------------------------------------------

    def step(self):
        """One iteration; a step that gave a request its first message ends by handing the
        loop its events (EventPump.hand_over: with the overlap schedule the GPU runs the next
        step meanwhile)."""
        self._admit_prealloc()
        self._poll_transfer()
        mode = super().step()
        if self._first is not None:
            sink, self._first = self._first, None
            sink.hand_over()
        return mode

    def _reserve_tokens(self) -> int:
        return self.config.decode_reserve_tokens * (len(self.running) + len(self.transfer))

    def _admit_prealloc(self) -> None:
        if any(r.receiver.poll() == KVPoll.Failed for r in self.prealloc):
            self._drop_failed_prealloc()  # its prefill peer died or refused the handshake
        if any(r.num_retractions for r in self.waiting):
            return  # retracted requests get their pages back first
        ps = self.memory.page_size
        while self.prealloc:
            req = self.prealloc[0]
            if len(self.running) + len(self.transfer) >= self.config.max_running:
                return
            need = -(-len(req.input_ids) // ps) * ps
            if not self.memory.ensure_free_tokens(need + self._reserve_tokens()):
                return
            if not self.memory.admit(req, use_cache=False):
                return
            if not self.memory.alloc_extend(req, len(req.input_ids)):
                self.memory.release(req)
                return
            self.prealloc.popleft()
            slots = self.memory.req_to_token.read(req.req_pool_idx, 0, len(req.input_ids))
            pages = (slots[::ps] // ps).tolist()
            req.t_prealloc = time.perf_counter()
            req_trace.stamp("registered", req.rid)
            try:
                req.receiver.init(pages)
            except (ValueError, RuntimeError, OSError) as e:
                self._discard(req, f"transfer setup failed: {e}")
                continue
            self.transfer.append(req)

    def _drop_failed_prealloc(self) -> None:
        for req in [r for r in self.prealloc if r.receiver.poll() == KVPoll.Failed]:
            self.prealloc.remove(req)
            self._discard(req, req.receiver.failure_reason or "KV transfer failed")

    def _poll_transfer(self) -> None:
        still = []
        for req in self.transfer:
            rx = req.receiver
            status = rx.poll()
            if status == KVPoll.Success:
                self._start_from_transfer(req, rx.aux)
            elif status == KVPoll.Failed:
                self._discard(req, rx.failure_reason or "KV transfer failed")
            else:
                still.append(req)
        self.transfer = still

    def _start_from_transfer(self, req: DecodeReq, aux: AuxData) -> None:
        """Build the running request from received pages + aux: no forward pass."""
        req.t_transferred = time.perf_counter()
        req_trace.stamp("transferred", req.rid)
        req.kv_len = len(req.input_ids)
        req.cached_tokens = int(aux.cached_tokens)
        tok = int(aux.first_token_id)
        req.output_ids.append(tok)
        if req.sampling.logprobs is not None:
            req.output_logprobs.append(float(aux.first_logprob))
            if req.sampling.logprobs:
                k = req.sampling.logprobs
                req.output_top_logprobs.append((list(aux.top_ids[:k]),
                                                list(aux.top_logprobs[:k])))
        self.token_done(req, tok, time.perf_counter())
        if req.finished:
            self.finish(req)
        else:
            self.running.append(req)

    def _discard(self, req: DecodeReq, reason: str) -> None:
        """Drop a request whose pages hold no valid KV: free them, never cache them."""
        if req.req_pool_idx is not None:
            allocated = len(req.input_ids) if req.kv_len == 0 else 0
            req.kv_len = 0
            self.memory.release(req, extra_slots=allocated)
        req.finish_reason = "abort"
        req.sink.put(ErrorEvent(reason))

    def snapshot(self) -> dict:
        st = self.memory.stats()
        return {"num_running": len(self.running),
                "num_waiting": len(self.prealloc) + len(self.transfer) + len(self.waiting),
                "num_inflight": len(self.transfer), "max_running": self.config.max_running,
                **st.__dict__}
