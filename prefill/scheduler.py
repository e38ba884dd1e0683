"""Prefill scheduler: bootstrap queue -> waiting queue -> extend batches -> KV send -> inflight.

A request enters the bootstrap queue with a KVSender for its room and waits there until decode
has registered destination pages (WaitingForInput); only then does it take KV memory. Pages are
sent as chunked prefill completes them; the last chunk (with the trailing partial page) carries
the aux data. The request's KV stays owned by it (not evictable) until the transfer ends; then
it goes to the radix cache, so a repeated prefix is not recomputed.
"""

from __future__ import annotations

import time

from pdserve.engine.req import Req
from pdserve.engine.schedule_batch import ScheduleBatch
from pdserve.engine.scheduler import Scheduler
from pdserve.kvtransfer.aux import AuxData
from pdserve.kvtransfer.poll import KVPoll


class PrefillScheduler(Scheduler):
    def __init__(self, *args, kv_manager, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv = kv_manager
        self.bootstrap: list[Req] = []
        self.inflight: list[Req] = []

    # ---- lifecycle hooks ---------------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queue a request whose `req.user` is its PrefillCtx (room, sender, reply callbacks)."""
        ctx = req.user
        super().add(req)
        self.waiting.remove(req)  # it waits for decode in the bootstrap queue first
        ctx.sender = self.kv.create_sender(ctx.room)
        ctx.t_bootstrap = time.perf_counter()
        self.bootstrap.append(req)

    @property
    def has_work(self) -> bool:
        return bool(super().has_work or self.bootstrap or self.inflight)

    def abort(self, rid: str, reason: str = "abort") -> Req | None:
        for q in (self.bootstrap, self.inflight):
            for r in q:
                if r.rid == rid:
                    q.remove(r)
                    self._fail(r, reason, release=q is self.inflight)
                    return r
        req = super().abort(rid, reason)
        if req is not None:
            req.user.sender.abort(reason)
        return req

    def on_prefill_done(self, req: Req) -> None:
        ctx = req.user
        first = req.output_ids[-1]
        lp = req.output_logprobs[-1] if req.output_logprobs else 0.0
        self._send_pages(req, last=True, aux=AuxData(first, float(lp), req.cached_tokens))
        ctx.t_sent = time.perf_counter()
        ctx.reply_first(req)
        self.inflight.append(req)

    def on_finish(self, req: Req) -> None:
        req.user.on_done(req)

    # ---- one iteration -----------------------------------------------------------------------

    def step(self):
        self._poll_bootstrap()
        self._poll_inflight()
        return super().step()

    def run_extend(self, batch: ScheduleBatch) -> None:
        super().run_extend(batch)
        for e in batch.entries:  # chunked requests ship their completed pages now
            if not e.completes and e.req.user.sender.poll() != KVPoll.Failed:
                self._send_pages(e.req, last=False)

    def _poll_bootstrap(self) -> None:
        still = []
        for req in self.bootstrap:
            sender = req.user.sender
            status = sender.poll()
            if status == KVPoll.Failed:
                self._fail(req, sender.failure_reason or "bootstrap failed", release=False)
            elif status >= KVPoll.WaitingForInput:
                need = -(-len(req.input_ids) // self.memory.page_size)
                if sender.num_dst_pages != need:
                    sender.abort(f"dst_pages: decode registered {sender.num_dst_pages} pages, "
                                 f"the prompt needs {need}")
                    self._fail(req, sender.failure_reason or "page count mismatch", False)
                    continue
                req.user.t_ready = time.perf_counter()
                self.waiting.append(req)
            else:
                still.append(req)
        self.bootstrap = still

    def _poll_inflight(self) -> None:
        still = []
        for req in self.inflight:
            status = req.user.sender.poll()
            if status == KVPoll.Success:
                self.memory.release(req)
                self.on_finish(req)
            elif status == KVPoll.Failed:
                self._fail(req, req.user.sender.failure_reason or "transfer failed", True)
            else:
                still.append(req)
        self.inflight = still

    # ---- helpers -----------------------------------------------------------------------------

    def _send_pages(self, req: Req, last: bool, aux: AuxData | None = None) -> None:
        ctx = req.user
        ps = self.memory.page_size
        end = -(-req.kv_len // ps) if last else req.kv_len // ps
        if end <= ctx.pages_sent and not last:
            return
        # Token i lies at offset i % ps of the request's (i // ps)-th page (page-aligned rows).
        slots = self.memory.slots_of(req, min(end * ps, req.kv_len))
        pages = (slots[::ps] // ps).tolist()[ctx.pages_sent:end]
        try:
            ctx.sender.send(pages, ctx.pages_sent, last, aux)
        except (ValueError, RuntimeError):
            return  # the room is Failed now; _poll_inflight / the next poll releases it
        ctx.pages_sent = end

    def _fail(self, req: Req, reason: str, release: bool) -> None:
        req.finish_reason = "abort"
        req.user.error = reason
        if release or req.req_pool_idx is not None:
            self.memory.release(req)
        self.on_finish(req)

    def snapshot(self) -> dict:
        st = self.memory.stats()
        return {"num_running": len(self.running) + (1 if self.chunked else 0),
                "num_waiting": len(self.waiting) + len(self.bootstrap),
                "num_inflight": len(self.inflight), **st.__dict__}
