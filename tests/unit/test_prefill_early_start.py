"""Prefill's early start: on an idle worker a request's prefill runs before decode registered its
pages; its pages go once decode has, and a failed bootstrap releases its KV wherever it is.

The sender stands in for KVSender with its contract: send() refuses a room decode has not
registered, a page count other than decode's, a chunk past the end or a last chunk without aux.
"""

from __future__ import annotations

import random
import time

import pytest

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.poll import KVPoll
from pdserve.prefill.scheduler import PrefillReq, PrefillScheduler
from pdserve.worker.events import ErrorEvent, PrefilledEvent


class Sender:
    def __init__(self, room: int) -> None:
        self.room = room
        self.status = KVPoll.Bootstrapping
        self.failure_reason: str | None = None
        self.num_dst_pages = 0
        self.sent: list[tuple[list[int], int, bool, object]] = []
        self.next_page = 0
        self.since = time.monotonic()  # when the status was entered (KVSender.since)

    def poll(self) -> KVPoll:
        return self.status

    def register(self, pages: int) -> None:  # decode's registration reached prefill
        self.num_dst_pages = pages
        self.status, self.since = KVPoll.WaitingForInput, time.monotonic()

    def send(self, pages, start: int, last: bool, aux=None) -> None:  # noqa: ANN001
        if self.status in (KVPoll.Failed, KVPoll.Success):
            return
        if self.status < KVPoll.WaitingForInput:
            raise RuntimeError(f"room {self.room}: send() before decode registered")
        end = start + len(pages)
        if start != self.next_page or end > self.num_dst_pages or (
                last and (end != self.num_dst_pages or aux is None)):
            self.abort("bad chunk")
            raise ValueError(f"room {self.room}: bad chunk [{start}, {end}) last={last}")
        self.next_page = end
        self.sent.append((list(pages), start, last, aux))
        self.status = KVPoll.Transferring

    def abort(self, reason: str = "aborted") -> None:
        if self.status != KVPoll.Success:
            self.status, self.failure_reason = KVPoll.Failed, reason


class Manager:
    def __init__(self) -> None:
        self.senders: dict[int, Sender] = {}

    def create_sender(self, room: int) -> Sender:
        self.senders[room] = Sender(room)
        return self.senders[room]


class Sink:
    def __init__(self) -> None:
        self.events: list[object] = []

    def put(self, event: object) -> None:
        self.events.append(event)


@pytest.fixture(scope="module")
def llm():
    return LLM(model_shape="tiny", device="cpu", num_pages=96)


def _scheduler(llm, chunk: int = 2048) -> tuple[PrefillScheduler, Manager]:
    llm.memory.tree.reset()
    kv = Manager()
    cfg = SchedulerConfig(max_running=8, chunked_prefill_size=chunk)
    return PrefillScheduler(llm.scheduler.runner, llm.memory, cfg, kv_manager=kv), kv


def _req(room: int, n: int) -> PrefillReq:
    ids = [random.randrange(5, 200) for _ in range(n)]
    return PrefillReq(rid=f"r{room}", input_ids=ids, room=room, sink=Sink(),
                      sampling=SamplingParams(max_tokens=4, temperature=0.0))


def _pages(req: PrefillReq, ps: int) -> int:
    return -(-len(req.input_ids) // ps)


def _run(sched: PrefillScheduler, steps: int = 8) -> None:
    for _ in range(steps):
        if sched.has_work:
            sched.step()


def test_an_idle_worker_prefills_before_decode_registers_and_sends_after(llm) -> None:
    sched, kv = _scheduler(llm)
    ps = llm.memory.page_size
    req = _req(1, 3 * ps + 5)
    sched.add(req)
    _run(sched)
    sender = kv.senders[1]
    assert req.output_ids and req in sched.held and not sender.sent  # prefilled, held
    assert not any(isinstance(e, PrefilledEvent) for e in req.sink.events)
    assert llm.memory.stats().kv_pages_in_use == _pages(req, ps)  # its KV kept meanwhile
    registered_at = time.perf_counter()
    sender.register(_pages(req, ps))
    time.sleep(0.3)  # the scheduler notices the registration later
    _run(sched, 1)
    assert [s[2] for s in sender.sent] == [True] and sender.sent[0][3].first_token_id == \
        req.output_ids[-1]
    answer = req.sink.events[-1]
    assert isinstance(answer, PrefilledEvent) and answer.first.token_ids == [req.output_ids[-1]]
    assert abs(req.t_ready - registered_at) < 0.1  # the bootstrap time ends at registration
    sender.status = KVPoll.Success
    _run(sched, 2)
    assert not sched.has_work and llm.memory.stats().kv_pages_in_use == 0


def test_chunks_prefilled_early_go_when_decode_registers(llm) -> None:
    sched, kv = _scheduler(llm, chunk=32)
    ps = llm.memory.page_size
    req = _req(2, 100)
    sched.add(req)
    sched.step()  # the first chunk of 32 tokens
    sender = kv.senders[2]
    assert req.kv_len == 32 and not sender.sent
    sender.register(_pages(req, ps))
    _run(sched)
    starts = [s[1] for s in sender.sent]
    assert starts[0] == 0 and sender.sent[-1][2] and sender.next_page == _pages(req, ps)
    sender.status = KVPoll.Success
    _run(sched, 2)
    assert llm.memory.stats().kv_pages_in_use == 0


@pytest.mark.parametrize("when", ["held", "running", "page_count"])
def test_a_failed_bootstrap_releases_an_early_request(llm, when: str) -> None:
    sched, kv = _scheduler(llm, chunk=32 if when == "running" else 2048)
    ps = llm.memory.page_size
    req = _req(3, 100)
    sched.add(req)
    sched.step() if when == "running" else _run(sched)
    sender = kv.senders[3]
    if when == "page_count":
        sender.register(_pages(req, ps) + 1)  # decode registered the wrong number of pages
    else:
        sender.abort("decode went away")
    _run(sched)
    assert not sched.has_work and not sched.early and not sched.held
    assert isinstance(req.sink.events[-1], ErrorEvent) and not sender.sent
    assert llm.memory.stats().kv_pages_in_use == 0


def test_a_busy_pool_waits_for_the_bootstrap(llm) -> None:
    """Past half the pool, a new request takes no KV before decode has registered."""
    sched, kv = _scheduler(llm)
    ps = llm.memory.page_size
    first = _req(4, 46 * ps)  # idle worker: starts at once, holding about half the pool
    sched.add(first)
    second = _req(5, 4 * ps)
    sched.add(second)
    assert first.early and not second.early and second in sched.bootstrap
    _run(sched)
    assert not second.output_ids  # not prefilled before its bootstrap
    kv.senders[5].register(_pages(second, ps))
    _run(sched)
    assert second.output_ids and kv.senders[5].sent
    for room in (4, 5):
        kv.senders[room].abort("done")
    _run(sched)
    assert llm.memory.stats().kv_pages_in_use == 0
