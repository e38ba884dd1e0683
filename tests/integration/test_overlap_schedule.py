"""Overlap scheduling (engine/overlap.py) gives exactly the outputs of the synchronous decode
loop, and leaves no KV page or request row held.

The overlapped loop is forced on for the CPU here (it is on by default only on CUDA): the
bookkeeping under test (placeholders, dropped tokens after a stop, deferred release, drains
before retraction, abort and history-dependent sampling) is the same on every device.
"""

from __future__ import annotations

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.overlap import OverlapDecoder
from pdserve.engine.sampling_params import SamplingParams

PROMPTS = [list(range(3, 3 + n)) for n in (9, 4, 17, 6, 11, 5, 8)]


def _params(stop_tok: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True),
    ]


def _run(model_dir: str, overlap: bool, num_pages: int, stop_tok: int,
         params: list[SamplingParams] | None = None):
    llm = LLM(model=model_dir, device="cpu", num_pages=num_pages, page_size=4, max_running=4)
    launches = []
    if overlap:
        ov = OverlapDecoder(llm.scheduler)
        launch = ov._launch
        ov._launch = lambda reqs, prev: launches.append(len(reqs)) or launch(reqs, prev)
        llm.scheduler.overlap = ov
    outs = llm.generate(PROMPTS, params or _params(stop_tok))
    st = llm.memory.stats()
    assert st.kv_pages_in_use == 0 and llm.memory.req_to_token.num_used == 0, st
    assert not llm.scheduler.has_work
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs], launches, llm


@pytest.fixture(scope="module")
def stop_tok(tiny_model_dir) -> int:
    llm = LLM(model=tiny_model_dir, device="cpu", num_pages=64, page_size=4)
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=9, temperature=0,
                                                    ignore_eos=True))[0]
    return out.token_ids[4]  # greedy reaches it mid-way: a stop that overlap must catch


@pytest.fixture(params=["from-greedy", "fixed"])
def stop_id(request: pytest.FixtureRequest, stop_tok: int) -> int:
    return stop_tok if request.param == "from-greedy" else 5


@pytest.mark.parametrize("num_pages", [128, 14])  # roomy, and tight enough to retract
def test_overlap_matches_synchronous_decode(tiny_model_dir, stop_id: int, num_pages: int):
    sync, _, _ = _run(tiny_model_dir, False, num_pages, stop_id)
    over, launches, llm = _run(tiny_model_dir, True, num_pages, stop_id)
    assert [o[:2] for o in over] == [o[:2] for o in sync]  # tokens and finish reasons
    for o, r in zip(over, sync):  # batches differ in size, so fp32 sums may differ in the ulp
        assert o[2] == pytest.approx(r[2], abs=1e-5)
    if stop_id != 5:
        assert sync[2][1] == "stop" and len(sync[2][0]) < 9  # the stop id really fired
    assert launches, "no decode step ran overlapped"
    if num_pages == 14:
        assert llm.scheduler.overlap.inflight is None


def test_overlap_abort_mid_flight_releases_everything(tiny_model_dir, stop_tok: int):
    llm = LLM(model=tiny_model_dir, device="cpu", num_pages=64, page_size=4, max_running=4)
    llm.scheduler.overlap = OverlapDecoder(llm.scheduler)
    from pdserve.engine.llm import OfflineReq
    from pdserve.engine.stop import TextStream

    sched = llm.scheduler
    sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    reqs = [OfflineReq(f"r{i}", p, sp, stream=TextStream.from_params(llm.tokenizer, sp, (), p))
            for i, p in enumerate(PROMPTS[:3])]
    for r in reqs:
        sched.add(r)
    for _ in range(6):  # prefill, then decode steps with one in flight
        sched.step()
    assert sched.overlap.inflight is not None
    sched.abort("r1")
    assert reqs[1].finished and -1 not in reqs[0].output_ids
    while sched.has_work:
        sched.step()
    assert [len(r.output_ids) for r in (reqs[0], reqs[2])] == [50, 50]
    st = llm.memory.stats()
    assert st.kv_pages_in_use == 0 and llm.memory.req_to_token.num_used == 0, st
