"""Decode scheduler: prealloc queue -> transfer queue -> running batch (+ local prefill).

A request with a bootstrap address first waits in the prealloc queue until pages for its whole
prompt fit (free pages minus a reserve for the running requests' growth), then registers those
pages with the prefill worker and waits in the transfer queue. On Success it becomes a running
request directly from the pages and the aux data (first token): no forward pass. A request
without a bootstrap address is prefilled here (mixed role / short prompts).
"""

from __future__ import annotations

import time
from collections import deque

from pdserve.engine.req import Req
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stream import StreamEvent
from pdserve.kvtransfer.poll import KVPoll


class DecodeScheduler(Scheduler):
    def __init__(self, *args, kv_manager=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv = kv_manager
        self.prealloc: deque[Req] = deque()
        self.transfer: list[Req] = []

    def add(self, req: Req) -> None:
        ctx = req.user
        super().add(req)
        if ctx.bootstrap_addr:
            if self.kv is None:
                self.waiting.remove(req)
                raise ValueError("bootstrap_addr: this worker has no KV transfer (mixed role)")
            self.waiting.remove(req)
            self.prealloc.append(req)

    @property
    def has_work(self) -> bool:
        return bool(super().has_work or self.prealloc or self.transfer)

    def abort(self, rid: str, reason: str = "abort") -> Req | None:
        for q in (self.prealloc, self.transfer):
            for r in list(q):
                if r.rid == rid:
                    q.remove(r)
                    if r.user.receiver is not None:
                        r.user.receiver.abort(reason)
                    self._discard(r, reason)
                    return r
        return super().abort(rid, reason)

    # ---- hooks: streaming --------------------------------------------------------------------

    def on_tokens(self, req: Req, num_new: int) -> None:
        req.user.emit_tokens(req, num_new)

    def on_finish(self, req: Req) -> None:
        req.user.emit_finish(req)

    # ---- one iteration -----------------------------------------------------------------------

    def step(self):
        self._admit_prealloc()
        self._poll_transfer()
        return super().step()

    def _reserve_tokens(self) -> int:
        return self.config.decode_reserve_tokens * (len(self.running) + len(self.transfer))

    def _admit_prealloc(self) -> None:
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
            ctx = req.user
            ctx.t_prealloc = time.perf_counter()
            try:
                ctx.receiver = self.kv.create_receiver(ctx.room, ctx.bootstrap_addr)
                ctx.receiver.init(pages)
            except (ValueError, RuntimeError, OSError) as e:
                self._discard(req, f"transfer setup failed: {e}")
                continue
            self.transfer.append(req)

    def _poll_transfer(self) -> None:
        still = []
        for req in self.transfer:
            rx = req.user.receiver
            status = rx.poll()
            if status == KVPoll.Success:
                self._start_from_transfer(req, rx.aux)
            elif status == KVPoll.Failed:
                self._discard(req, rx.failure_reason or "KV transfer failed")
            else:
                still.append(req)
        self.transfer = still

    def _start_from_transfer(self, req: Req, aux) -> None:
        """Build the running request from received pages + aux: no forward pass."""
        req.user.t_transferred = time.perf_counter()
        req.kv_len = len(req.input_ids)
        req.cached_tokens = int(aux.cached_tokens)
        tok = int(aux.first_token_id)
        req.output_ids.append(tok)
        if req.sampling.logprobs is not None:
            req.output_logprobs.append(float(aux.first_logprob))
            if req.sampling.logprobs:
                req.output_top_logprobs.append(([tok], [float(aux.first_logprob)]))
        self.token_done(req, tok, time.perf_counter())
        if req.finished:
            self.finish(req)
        else:
            self.running.append(req)

    def _discard(self, req: Req, reason: str) -> None:
        """Drop a request whose pages hold no valid KV: free them, never cache them."""
        if req.req_pool_idx is not None:
            allocated = len(req.input_ids) if req.kv_len == 0 else 0
            req.kv_len = 0
            self.memory.release(req, extra_slots=allocated)
        req.finish_reason = "abort"
        req.user.emit(StreamEvent("error", message=reason))
        self.on_finish(req)

    def snapshot(self) -> dict:
        st = self.memory.stats()
        return {"num_running": len(self.running),
                "num_waiting": len(self.prealloc) + len(self.transfer) + len(self.waiting),
                "num_inflight": len(self.transfer), **st.__dict__}
