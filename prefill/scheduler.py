"""Prefill scheduler: bootstrap queue -> waiting queue -> extend batches -> KV send -> inflight.

A request enters the bootstrap queue with a KVSender for its room and waits there until decode
has registered destination pages (WaitingForInput); only then does it take KV memory. Pages are
sent as chunked prefill completes them; the last chunk (with the trailing partial page) carries
the aux data. The request's KV stays owned by it (not evictable) until the transfer ends; then
it goes to the radix cache, so a repeated prefix is not recomputed.

Early start: on an idle worker, or while live requests hold less than EARLY_START_SHARE of the
pool, a request goes to the waiting queue at once and its prefill runs during the bootstrap
(which is then off its time to first token). Its pages are sent once decode has registered;
a prefill that finished first waits in `held`, its KV kept, until then. A bootstrap that fails
aborts it wherever it is, and its KV is released as for any other failure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine import req_trace
from pdserve.engine.req import Req
from pdserve.engine.schedule_batch import ScheduleBatch
from pdserve.engine.scheduler import Scheduler
from pdserve.kvtransfer.aux import AuxData
from pdserve.kvtransfer.poll import KVPoll
from pdserve.kvtransfer.sender import KVSender
from pdserve.worker.events import (
    ErrorEvent,
    EventSink,
    PrefilledEvent,
    StageTimes,
    TokenOutput,
)


@dataclass
class PrefillReq(Req):
    """A request on the prefill worker: its room, where its events go, and its KV sender."""

    room: int = 0
    sink: EventSink | None = None
    sender: KVSender | None = None  # created when the request enters the bootstrap queue
    pages_sent: int = 0  # pages [0, pages_sent) were handed to the sender
    error: str = ""  # why it failed, when it did
    t_bootstrap: float = 0.0
    t_ready: float = 0.0  # decode registered its pages
    early: bool = False  # started before decode registered (see the module doc)
    aux: AuxData | None = None  # a held request's first token, until its pages go


# Live requests' share of the pool below which a new request starts before its bootstrap.
EARLY_START_SHARE = 0.5


class PrefillScheduler(Scheduler):
    def __init__(self, *args, kv_manager, early_start: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv = kv_manager
        self.early_start = early_start
        self.bootstrap: list[PrefillReq] = []
        self.early: list[PrefillReq] = []  # started early, decode not registered yet
        self.held: list[PrefillReq] = []  # ... and prefilled: KV kept until decode registers
        self.inflight: list[PrefillReq] = []

    # ---- lifecycle hooks ---------------------------------------------------------------------

    def add(self, req: PrefillReq) -> None:
        """Queue a request in the bootstrap queue (it waits there for decode's pages first), or
        straight in the waiting queue when it may start early."""
        req.sender = self.kv.create_sender(req.room)
        req.t_bootstrap = time.perf_counter()
        if self._may_start_early(req):
            req.early = True
            self.early.append(req)
            super().add(req)
        else:
            self.bootstrap.append(req)

    def _may_start_early(self, req: PrefillReq) -> bool:
        if not self.early_start:
            return False
        st = self.memory.stats()
        need = -(-len(req.input_ids) // self.memory.page_size)
        held = sum(-(-len(r.input_ids) // self.memory.page_size) for r in self.early)
        if st.kv_pages_in_use == 0 and not self.early:
            return True  # an idle worker: nothing else could wait behind this request's KV
        return st.kv_pages_in_use + held + need <= EARLY_START_SHARE * st.kv_pages_total

    @property
    def has_work(self) -> bool:
        return bool(super().has_work or self.bootstrap or self.held or self.inflight)

    def abort(self, rid: str, reason: str = "abort") -> Req | None:
        for q in (self.bootstrap, self.held, self.inflight):
            for r in q:
                if r.rid == rid:
                    q.remove(r)
                    if q is self.held:
                        self.early.remove(r)
                        r.sender.abort(reason)
                    self._fail(r, reason, release=q is not self.bootstrap)
                    return r
        req = super().abort(rid, reason)
        if req is not None:
            if req in self.early:
                self.early.remove(req)
            req.sender.abort(reason)
        return req

    def on_prefill_done(self, req: PrefillReq) -> None:
        """The first token, its logprob and top alternatives travel to decode in the aux data
        of the last chunk; the RPC answers with the cached-token count and timings. A request
        that started early and whose decode has not registered yet is held until it has."""
        top_ids, top_lps = req.output_top_logprobs[-1] if req.output_top_logprobs else ((), ())
        lp = req.output_logprobs[-1] if req.output_logprobs else 0.0
        aux = AuxData(req.output_ids[-1], float(lp), req.cached_tokens, tuple(top_ids),
                      tuple(top_lps))
        if not req.t_ready and req in self.early and self._registered(req) == "":
            self.early.remove(req)  # decode registered during the extend: no step's wait
        if not req.t_ready:
            req.aux = aux
            self.held.append(req)
            return
        self._hand_over(req, aux)

    def _hand_over(self, req: PrefillReq, aux: AuxData) -> None:
        """Answer the RPC (with the first token, which the router streams at once), then send
        the request's (remaining) pages with the aux data."""
        ms = 1000.0
        timings = StageTimes(
            bootstrap_ms=(req.t_ready - req.t_bootstrap) * ms,
            queue_ms=max(0.0, (time.perf_counter() - req.t_ready - req.prefill_s) * ms),
            prefill_ms=req.prefill_s * ms)
        req.sink.put(PrefilledEvent(req.cached_tokens, req.finish_reason or "", timings,
                                    TokenOutput.last_of(req, 1)))
        self._send_pages(req, last=True, aux=aux)
        self.inflight.append(req)

    def on_finish(self, req: PrefillReq) -> None:
        # Every request's handler gets a final event: this error, unless PrefilledEvent already
        # answered it (the channel then drops it).
        req.sink.put(ErrorEvent(req.error or req.finish_reason or "aborted"))

    # ---- one iteration -----------------------------------------------------------------------

    def step(self):
        self._poll_bootstrap()
        self._poll_inflight()
        return super().step()

    def run_extend(self, batch: ScheduleBatch) -> None:
        super().run_extend(batch)
        for e in batch.entries:  # chunked requests ship their completed pages now
            if not e.completes and e.req.t_ready and e.req.sender.poll() != KVPoll.Failed:
                self._send_pages(e.req, last=False)

    def _poll_bootstrap(self) -> None:
        still = []
        for req in self.bootstrap:
            why = self._registered(req)
            if why is None:
                still.append(req)
            elif why:
                self._fail(req, why, release=False)
            else:
                self.waiting.append(req)
        self.bootstrap = still
        for req in [r for r in self.early if self._registered(r) is not None]:
            self._early_registered(req)

    def _registered(self, req: PrefillReq) -> str | None:
        """None while decode has not registered; "" once it has (t_ready set); else why the
        bootstrap failed (the room is Failed)."""
        sender = req.sender
        status = sender.poll()
        if status == KVPoll.Failed:
            return sender.failure_reason or "bootstrap failed"
        if status < KVPoll.WaitingForInput:
            return None
        need = -(-len(req.input_ids) // self.memory.page_size)
        if sender.num_dst_pages != need:
            sender.abort(f"dst_pages: decode registered {sender.num_dst_pages} pages, "
                         f"the prompt needs {need}")
            return sender.failure_reason or "page count mismatch"
        # When decode registered (the room entered WaitingForInput), not when this noticed it:
        # an early request notices only after its extend.
        since = sender.since if status == KVPoll.WaitingForInput else time.monotonic()
        req.t_ready = time.perf_counter() - max(0.0, time.monotonic() - since)
        req_trace.stamp("bootstrapped", req.rid, since)
        return ""

    def _early_registered(self, req: PrefillReq) -> None:
        """An early request's bootstrap ended: send what its prefill completed, or fail it."""
        self.early.remove(req)
        if not req.t_ready:  # failed: wherever the request is, it ends with its KV released
            why = req.sender.failure_reason or "bootstrap failed"
            if req in self.held:
                self.held.remove(req)
                self._fail(req, why, release=True)
            else:
                req.error = why
                Scheduler.abort(self, req.rid, "abort")
            return
        if req in self.held:
            self.held.remove(req)
            self._hand_over(req, req.aux)
        elif req.kv_len:  # part-way through a chunked prefill: the pages it has so far
            self._send_pages(req, last=False)

    def _poll_inflight(self) -> None:
        still = []
        for req in self.inflight:
            status = req.sender.poll()
            if status == KVPoll.Success:
                self.memory.release(req)
                self.on_finish(req)
            elif status == KVPoll.Failed:
                self._fail(req, req.sender.failure_reason or "transfer failed", True)
            else:
                still.append(req)
        self.inflight = still

    # ---- helpers -----------------------------------------------------------------------------

    def _send_pages(self, req: PrefillReq, last: bool, aux: AuxData | None = None) -> None:
        ps = self.memory.page_size
        end = -(-req.kv_len // ps) if last else req.kv_len // ps
        if end <= req.pages_sent and not last:
            return
        # Token i lies at offset i % ps of the request's (i // ps)-th page (page-aligned rows).
        slots = self.memory.slots_of(req, min(end * ps, req.kv_len))
        pages = (slots[::ps] // ps).tolist()[req.pages_sent:end]
        try:
            req.sender.send(pages, req.pages_sent, last, aux)
        except (ValueError, RuntimeError):
            return  # the room is Failed now; _poll_inflight / the next poll releases it
        req.pages_sent = end

    def _fail(self, req: PrefillReq, reason: str, release: bool) -> None:
        req.finish_reason = "abort"
        req.error = reason
        if release or req.req_pool_idx is not None:
            self.memory.release(req)
        self.on_finish(req)

    def snapshot(self) -> dict:
        st = self.memory.stats()
        return {"num_running": len(self.running) + (1 if self.chunked else 0),
                "num_waiting": len(self.waiting) + len(self.bootstrap),
                "num_inflight": len(self.inflight) + len(self.held),
                "max_running": self.config.max_running,
                **st.__dict__}
