"""SLO dispatch: where a request's prefill runs, from its prompt length and the current load.

Conditional disaggregation (router/disagg.py) places a prefill by prompt length alone. With
`--slo-ttft-ms` set, the router also weighs what it sees of the load, per worker:
- a prefill worker's queue: the uncached prompt tokens this router sent it whose first token
  has not come back yet, and its prefill rate (tokens/s), learned from those first tokens
  (the queue ahead of a request plus its own tokens, over its time to first token: queueing,
  transfer and the decode side's first step included, so the estimate is of TTFT itself);
- a decode worker's inter-token latency, from the tokens it streams through this router, and
  the same queue and rate for the prompts it prefills itself.
A prefill on the decode worker stalls its running batch. It may spend the share of time the
inter-token SLO leaves free, `1 - ITL / slo_itl`: while ITL is under the SLO, stalling that
share of the time keeps the mean (TPOT) under it. That share accrues as a stall budget (capped
at `slo_ttft_ms` of stall; full when the worker streams nothing) and each local prefill spends
its expected stall.

Rules, on top of the length decision:
- remote, but the estimated remote TTFT exceeds `slo_ttft_ms`: prefill locally when the stall
  fits the budget and the local estimate is lower ("prefill_busy");
- local (a short prompt), but the stall does not fit and the remote estimate meets the SLO:
  prefill remotely ("decode_busy").
Until a worker's rate has been measured, the length decision stands.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from pdserve.router.disagg import DisaggDecision
from pdserve.router.events import FlowEvent
from pdserve.router.registry import WorkerEntry

RATE_ALPHA = 0.3  # EWMA weight of a new prefill-rate sample (few, informative samples)
ITL_ALPHA = 0.05  # ... of a new inter-token gap (many, noisy samples)
ITL_STALE_S = 1.0  # an ITL older than this says nothing about the running batch


@dataclass
class WorkerLoad:
    """What the router has seen of one worker's prefill queue and token stream."""

    queued_tokens: int = 0
    rate_tok_s: float | None = None
    itl_ms: float | None = None
    itl_at: float = 0.0
    budget_ms: float | None = None  # None: full (not spent yet)
    budget_at: float = 0.0

    def learn_rate(self, tokens: int, elapsed_s: float) -> None:
        sample = tokens / max(elapsed_s, 1e-3)
        self.rate_tok_s = sample if self.rate_tok_s is None else (
            (1 - RATE_ALPHA) * self.rate_tok_s + RATE_ALPHA * sample)

    def learn_itl(self, gap_ms: float, now: float) -> None:
        fresh = self.itl_ms is not None and now - self.itl_at <= ITL_STALE_S
        self.itl_ms = (1 - ITL_ALPHA) * self.itl_ms + ITL_ALPHA * gap_ms if fresh else gap_ms
        self.itl_at = now

    def estimate_ms(self, tokens: int) -> float | None:
        """Time to first token for `tokens` more prompt tokens behind the queue."""
        if self.rate_tok_s is None:
            return None
        return (self.queued_tokens + tokens) / self.rate_tok_s * 1e3


class SloDispatcher:
    """Reviews conditional-disaggregation decisions against the load (see module docstring)."""

    def __init__(self, slo_ttft_ms: float, slo_itl_ms: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slo_ttft_ms = slo_ttft_ms
        self.slo_itl_ms = slo_itl_ms
        self.clock = clock
        self.loads: dict[str, WorkerLoad] = {}

    def load(self, worker: WorkerEntry) -> WorkerLoad:
        if worker.worker_id not in self.loads:
            self.loads[worker.worker_id] = WorkerLoad()
        return self.loads[worker.worker_id]

    def forget_except(self, live: Sequence[WorkerEntry]) -> None:
        keep = {w.worker_id for w in live}
        for wid in [w for w in self.loads if w not in keep]:
            del self.loads[wid]

    # ---- the decision ---------------------------------------------------------------------

    def _budget_ms(self, decode: WorkerEntry, now: float) -> float:
        """Stall the decode worker can take now; refilled at the share its ITL leaves free."""
        load = self.load(decode)
        cap = self.slo_ttft_ms
        if load.budget_ms is None:
            return cap
        streaming = decode.inflight > 0 and load.itl_ms is not None and \
            now - load.itl_at <= ITL_STALE_S
        free = 1.0 if not streaming else max(0.0, 1.0 - load.itl_ms / self.slo_itl_ms)
        return min(cap, load.budget_ms + free * (now - load.budget_at) * 1e3)

    def review(self, decision: DisaggDecision, prefill: Sequence[WorkerEntry],
               decode: WorkerEntry) -> DisaggDecision:
        if not prefill or decision.reason not in ("always", "long_prompt", "short_prompt"):
            return decision
        now = self.clock()
        u = decision.uncached_len
        remotes = [e for e in (self.load(w).estimate_ms(u) for w in prefill) if e is not None]
        remote_ms = min(remotes) if remotes else None
        local = self.load(decode)
        # Not measured on the decode worker yet: the prefill workers' best rate stands in.
        rates = [r for r in (self.load(w).rate_tok_s for w in prefill) if r]
        rate = local.rate_tok_s or (max(rates) if rates else None)
        local_ms = stall_ms = None
        if rate:
            local_ms = (local.queued_tokens + u) / rate * 1e3
            stall_ms = u / rate * 1e3
        budget = self._budget_ms(decode, now)
        fits = self.slo_itl_ms > 0 and stall_ms is not None and stall_ms <= budget
        info = {"remote_ms": remote_ms, "local_ms": local_ms, "stall_ms": stall_ms,
                "budget_ms": budget}
        out = replace(decision, slo=info)
        if decision.disaggregated:
            if remote_ms is not None and remote_ms > self.slo_ttft_ms and fits and \
                    local_ms is not None and local_ms < remote_ms:
                out = replace(out, disaggregated=False, reason="prefill_busy")
        elif self.slo_itl_ms > 0 and stall_ms is not None and not fits and \
                remote_ms is not None and remote_ms <= self.slo_ttft_ms:
            out = replace(out, disaggregated=True, reason="decode_busy")
        if not out.disaggregated and stall_ms is not None:
            local.budget_ms, local.budget_at = budget - stall_ms, now
        return out

    # ---- what the request shows of the load ------------------------------------------------

    async def watch(self, events: AsyncIterator[FlowEvent], prefill: WorkerEntry,
                    decode: WorkerEntry, tokens: int) -> AsyncIterator[FlowEvent]:
        """Pass `events` through; count `tokens` in `prefill`'s queue until the first token,
        learn its rate from that token and `decode`'s ITL from the rest."""
        pload, dload = self.load(prefill), self.load(decode)
        ahead = pload.queued_tokens
        pload.queued_tokens += tokens
        queued = True
        start = last = self.clock()
        try:
            async for event in events:
                if event.token_ids:
                    now = self.clock()
                    if queued:
                        queued = False
                        pload.queued_tokens -= tokens
                        pload.learn_rate(ahead + tokens, now - start)
                    else:
                        dload.learn_itl((now - last) * 1e3 / len(event.token_ids), now)
                    last = now
                yield event
        finally:
            if queued:
                pload.queued_tokens -= tokens
            await events.aclose()  # type: ignore[attr-defined]
