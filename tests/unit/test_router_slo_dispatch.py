"""The SLO dispatcher: prefill placement from prompt length and the load the router observes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.disagg import DisaggDecision, DisaggPolicy
from pdserve.router.events import FlowEvent
from pdserve.router.registry import WorkerEntry
from pdserve.router.slo_dispatch import SloDispatcher


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _worker(wid: str, role: str) -> WorkerEntry:
    return WorkerEntry(worker_id=wid, address=f"127.0.0.1:{len(wid)}", role=role, static=True,
                       state="healthy")


def _remote(n: int) -> DisaggDecision:
    return DisaggDecision(True, "always", n, n, 0)


def _short(n: int) -> DisaggDecision:
    return DisaggDecision(False, "short_prompt", n, n, 64)


async def _events(clock: Clock, gaps_s: list[float], fail: bool = False
                  ) -> AsyncIterator[FlowEvent]:
    """A request's token events, the clock moved by each gap before each token."""
    for gap in gaps_s:
        clock.t += gap
        yield FlowEvent(request_id="r", token_ids=[1])
    if fail:
        raise RuntimeError("leg failed")


async def _drain(gen: AsyncIterator[FlowEvent]) -> int:
    n = 0
    async for _ in gen:
        n += 1
    return n


def _learn_prefill_rate(slo: SloDispatcher, clock: Clock, p: WorkerEntry, d: WorkerEntry,
                        tokens: int, ttft_s: float) -> None:
    asyncio.run(_drain(slo.watch(_events(clock, [ttft_s]), p, d, tokens)))


def test_nothing_measured_keeps_the_length_decision():
    slo = SloDispatcher(1000, 12, Clock())
    p, d = _worker("p", "prefill"), _worker("d", "decode")
    got = slo.review(_remote(4096), [p], d)
    assert got.disaggregated and got.reason == "always"
    assert got.slo == {"remote_ms": None, "local_ms": None, "stall_ms": None,
                       "budget_ms": 1000}
    assert slo.review(_short(8), [p], d).reason == "short_prompt"
    assert slo.review(_remote(10), [], d).reason == "always"  # no prefill pool: untouched


def test_busy_prefill_queue_moves_long_prompts_to_the_decode_worker_within_budget():
    clock = Clock()
    slo = SloDispatcher(1000, 12, clock)
    p, d = _worker("p", "prefill"), _worker("d", "decode")
    _learn_prefill_rate(slo, clock, p, d, 1000, 0.5)  # 2000 tokens/s, queue empty again
    assert slo.load(p).rate_tok_s == pytest.approx(2000) and slo.load(p).queued_tokens == 0
    ok = slo.review(_remote(1000), [p], d)  # 0.5 s: under the SLO
    assert ok.disaggregated and ok.slo["remote_ms"] == pytest.approx(500)
    slo.load(p).queued_tokens = 3000  # three requests ahead: 2 s
    moved = slo.review(_remote(1000), [p], d)
    assert not moved.disaggregated and moved.reason == "prefill_busy"
    assert moved.slo["local_ms"] == pytest.approx(500) and moved.slo["stall_ms"] == 500
    assert moved.to_json()["slo"]["remote_ms"] == 2000.0
    again = slo.review(_remote(1000), [p], d)  # the other half of the budget
    assert again.reason == "prefill_busy" and again.slo["budget_ms"] == pytest.approx(500)
    spent = slo.review(_remote(1000), [p], d)  # budget gone: stays remote
    assert spent.disaggregated and spent.slo["budget_ms"] == pytest.approx(0)
    clock.t += 0.6  # idle decode: the budget refills at full speed
    assert slo.review(_remote(1000), [p], d).reason == "prefill_busy"


def test_budget_refills_at_the_share_the_itl_slo_leaves_free():
    clock = Clock()
    slo = SloDispatcher(1000, 12, clock)
    p, d = _worker("p", "prefill"), _worker("d", "decode")
    _learn_prefill_rate(slo, clock, p, d, 2000, 1.0)  # 2000 tokens/s
    # d streams at 6 ms per token: half of each 12 ms may go to local prefills.
    d.inflight = 1
    asyncio.run(_drain(slo.watch(_events(clock, [0.01] + [0.006] * 50), d, d, 20)))
    assert slo.load(d).itl_ms == pytest.approx(6.0)
    assert slo.load(d).rate_tok_s == pytest.approx(2000)  # its own prefill: 20 in 10 ms
    slo.load(p).queued_tokens = 4000
    assert slo.review(_remote(1800), [p], d).reason == "prefill_busy"  # 900 of 1000 ms
    clock.t += 0.5  # 500 ms at half speed: 250 ms more, 350 ms in all
    assert slo.review(_remote(1000), [p], d).disaggregated
    got = slo.review(_remote(600), [p], d)
    assert got.reason == "prefill_busy" and got.slo["budget_ms"] == pytest.approx(350)
    # A decode worker at its ITL SLO gets no budget back at all.
    slo.load(d).itl_ms, slo.load(d).itl_at = 12.0, clock.t
    clock.t += 0.5
    assert slo.review(_remote(200), [p], d).disaggregated  # 100 ms > the 50 left


def test_short_prompts_leave_a_decode_worker_without_slack():
    clock = Clock()
    slo = SloDispatcher(1000, 12, clock)
    p, d = _worker("p", "prefill"), _worker("d", "decode")
    _learn_prefill_rate(slo, clock, p, d, 1000, 0.1)  # 10k tokens/s
    load = slo.load(d)
    load.budget_ms, load.budget_at = 0.0, clock.t
    load.itl_ms, load.itl_at, d.inflight = 13.0, clock.t, 4
    got = slo.review(_short(50), [p], d)
    assert got.disaggregated and got.reason == "decode_busy"
    slo.load(p).queued_tokens = 20000  # the prefill side would miss the TTFT: stay local
    assert slo.review(_short(50), [p], d).reason == "short_prompt"
    assert slo.review(_short(50), [p], d).slo["budget_ms"] < 0  # local stalls run a debt


def test_watch_counts_the_queue_until_the_first_token_and_on_failure():
    clock = Clock()
    slo = SloDispatcher(1000, 12, clock)
    p, d = _worker("p", "prefill"), _worker("d", "decode")

    async def gated(gate: asyncio.Event, fail: bool) -> AsyncIterator[FlowEvent]:
        await gate.wait()
        if fail:
            raise RuntimeError("leg failed")
        clock.t += 0.4
        yield FlowEvent(request_id="r", token_ids=[1])
        clock.t += 0.01
        yield FlowEvent(request_id="r", token_ids=[2, 3])

    async def scenario() -> None:
        gates = [asyncio.Event(), asyncio.Event()]
        ok = asyncio.ensure_future(_drain(slo.watch(gated(gates[0], False), p, d, 300)))
        bad = asyncio.ensure_future(_drain(slo.watch(gated(gates[1], True), p, d, 500)))
        await asyncio.sleep(0)
        assert slo.load(p).queued_tokens == 800  # both wait for their first token
        gates[1].set()
        with pytest.raises(RuntimeError):
            await bad
        assert slo.load(p).queued_tokens == 300  # the failed one left the queue
        gates[0].set()
        assert await ok == 2
        assert slo.load(p).queued_tokens == 0
        # 300 tokens of its own plus 500 ahead (it was first, so none): 300 / 0.4 s.
        assert slo.load(p).rate_tok_s == pytest.approx(750)
        assert slo.load(d).itl_ms == pytest.approx(5.0)  # 10 ms over two tokens

    asyncio.run(scenario())
    slo.forget_except([d])
    assert set(slo.loads) == {"d"}


def test_review_runs_before_the_decode_worker_learns_the_prefix():
    policy = DisaggPolicy(16, block_len=4)
    d = _worker("d", "decode")
    prompt = list(range(40))

    def to_local(dec: DisaggDecision) -> DisaggDecision:
        return DisaggDecision(False, "prefill_busy", dec.prompt_len, dec.uncached_len,
                              dec.threshold)

    moved = policy.decide(prompt, d, True, False, to_local)
    assert moved is not None and moved.reason == "prefill_busy"
    # d prefilled it: the same prompt again finds it cached there.
    assert policy.decide(prompt, d, True, False).uncached_len == 0

    def to_remote(dec: DisaggDecision) -> DisaggDecision:
        return DisaggDecision(True, "decode_busy", dec.prompt_len, dec.uncached_len,
                              dec.threshold)

    other = list(range(100, 110))
    assert policy.decide(other, d, True, False, to_remote).disaggregated
    assert policy.decide(other, d, True, False).uncached_len == 10  # not learned


def test_config_fields():
    with pytest.raises(ValueError, match="slo_ttft_ms"):
        RouterConfig(slo_ttft_ms=-1)
    with pytest.raises(ValueError, match="slo_itl_ms"):
        RouterConfig(slo_itl_ms=12)
    assert RouterConfig(slo_ttft_ms=1000, slo_itl_ms=12).slo_itl_ms == 12
    from pdserve.router.main import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["--slo-ttft-ms", "1000",
                                                      "--slo-itl-ms", "12"]))
    assert cfg.slo_ttft_ms == 1000 and cfg.slo_itl_ms == 12
