"""A request's prefill time (the stage times' prefill_ms) ends when its first token is read back."""

from __future__ import annotations

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams


def test_prefill_time_lasts_until_the_first_token_is_read_back(monkeypatch) -> None:
    """On CUDA the forward only launches; the sampled tokens' read-back is where the host
    waits for it. A request's prefill_s (the stage times' prefill_ms) must include that wait:
    here a sampler that returns 0.2 s late stands for a device still running."""
    import time

    llm = LLM(model_shape="tiny", device="cpu")
    sched, runner = llm.scheduler, llm.scheduler.runner
    seen: list[float] = []
    real_done, real_sample = sched.on_prefill_done, runner.sample

    def done(req):  # noqa: ANN001, ANN202
        seen.append(req.prefill_s)
        real_done(req)

    def late(logits, reqs):  # noqa: ANN001, ANN202
        out = real_sample(logits, reqs)
        time.sleep(0.2)
        return out

    monkeypatch.setattr(sched, "on_prefill_done", done)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second is the baseline, warm
        llm.generate([[5, 6, 7, 8]], sp)
    monkeypatch.setattr(runner, "sample", late)
    llm.generate([[9, 6, 7, 8]], sp)
    assert len(seen) == 3 and seen[2] >= seen[1] + 0.15, seen
