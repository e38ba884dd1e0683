"""Sampler: greedy parity, filters never leak, seeded draws independent of batch layout,
penalties against a slow reference, sampling distribution, min_tokens, logprobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.sampler import Sampler, SamplingBatch, apply_penalties
from pdserve.engine.sampling_params import SamplingParams

V = 64
SAMPLER = Sampler()


def sample(logits: torch.Tensor, params: list[SamplingParams],
           output_ids: list[list[int]] | None = None,
           prompt_ids: list[list[int]] | None = None, eos: tuple[int, ...] = ()):
    output_ids = output_ids if output_ids is not None else [[] for _ in params]
    batch = SamplingBatch.build(params, output_ids, prompt_ids, logits.shape[1], logits.device,
                                eos_token_ids=eos)
    return SAMPLER.sample(logits, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_argmax(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(32, 1000, generator=gen) * 3).to(dtype)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: argmax takes the first
    out = sample(logits, [SamplingParams(temperature=0.0)] * 32)
    assert torch.equal(out.next_token_ids, torch.argmax(logits, dim=-1))
    assert out.next_token_ids.dtype == torch.int64 and out.logprobs is None


def test_greedy_rows_unaffected_by_random_rows() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.3, top_k=5) for i in range(6)]
    out = sample(logits, params)
    assert torch.equal(out.next_token_ids[1::2], torch.argmax(logits[1::2], dim=-1))


def test_sample_does_not_sync_or_mutate(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(4, V)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.01, seed=7,
                             repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=3,
                             logprobs=4), SamplingParams(temperature=0), SamplingParams(),
              SamplingParams(top_p=0.5, presence_penalty=1.0)]
    batch = SamplingBatch.build(params, [[1, 2], [3], [], [4, 4]], [[5], [6], [7], [8]], V,
                                "cpu", eos_token_ids=(0,))

    def forbidden(*_a, **_k):
        raise AssertionError("host sync in the sampling hot path")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    out = SAMPLER.sample(logits, batch)
    monkeypatch.undo()
    assert torch.equal(logits, before)
    assert out.top_logprob_ids is not None and out.top_logprob_ids.shape == (4, 4)


def _random_logits(seed: int, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 20),
       temperature=st.floats(0.05, 3.0))
def test_top_k_never_picks_outside_top_k(seed: int, k: int, temperature: float) -> None:
    logits = _random_logits(seed, 8, 40).repeat(16, 1)
    out = sample(logits, [SamplingParams(top_k=k, temperature=temperature)] * len(logits))
    kth = torch.topk(logits, k, dim=-1).values[:, -1]
    chosen = logits.gather(1, out.next_token_ids[:, None]).squeeze(1)
    assert bool((chosen >= kth).all())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), p=st.floats(0.05, 0.99),
       temperature=st.floats(0.1, 3.0))
def test_top_p_never_picks_outside_nucleus(seed: int, p: float, temperature: float) -> None:
    logits = _random_logits(seed, 8, 40).repeat(16, 1)
    out = sample(logits, [SamplingParams(top_p=p, temperature=temperature)] * len(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    chosen_p = probs.gather(1, out.next_token_ids[:, None])
    # Mass strictly more likely than the chosen token must not already reach p.
    mass_above = (probs * (probs > chosen_p)).sum(dim=-1)
    assert bool((mass_above < p + 1e-5).all())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), min_p=st.floats(0.01, 1.0),
       top_k=st.sampled_from([-1, 3]), top_p=st.sampled_from([1.0, 0.8]))
def test_min_p_never_picks_below_threshold(seed: int, min_p: float, top_k: int,
                                           top_p: float) -> None:
    logits = _random_logits(seed, 8, 40).repeat(16, 1)
    params = [SamplingParams(min_p=min_p, top_k=top_k, top_p=top_p)] * len(logits)
    out = sample(logits, params)
    probs = torch.softmax(logits, dim=-1)
    chosen_p = probs.gather(1, out.next_token_ids[:, None]).squeeze(1)
    assert bool((chosen_p >= min_p * probs.max(dim=-1).values - 1e-6).all())


def test_seeded_draw_independent_of_batch_composition_and_position() -> None:
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1, V, generator=gen)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=3, seed=9)]
    draws = set()
    for pos in range(4):
        for n_others in (0, 1, 3):
            rest = torch.randn(n_others, V, generator=gen)
            at = min(pos, n_others)
            logits = torch.cat([rest[:at], row, rest[at:]])
            params = others[:at] + [seeded] + others[at:n_others]
            outs = [[7, 8]] * len(params)
            token = sample(logits, params, output_ids=outs).next_token_ids[at]
            draws.add(int(token))
    assert len(draws) == 1


def _toy_logits(prefix: list[int]) -> torch.Tensor:
    """A deterministic 'model': logits depend only on the tokens so far."""
    gen = torch.Generator().manual_seed(hash(tuple(prefix)) & 0xFFFFFFFF)
    return torch.randn(V, generator=gen) * 2


def _generate(params: SamplingParams, prompt: list[int], steps: int, split: bool,
              filler: int) -> list[int]:
    """Generate `steps` tokens; `split` samples token 0 alone (prefill) and the rest in a
    batch next to `filler` unrelated rows (decode), as the P/D path does."""
    out: list[int] = []
    for t in range(steps):
        n_extra = filler if (split and t > 0) else 0
        logits = torch.stack([_toy_logits(prompt + out)] + [
            _toy_logits([t, i]) for i in range(n_extra)])
        plist = [params] + [SamplingParams(seed=t + i) for i in range(n_extra)]
        outs = [out] + [[1] * t for _ in range(n_extra)]
        out.append(int(sample(logits, plist, outs, [prompt] * len(plist)).next_token_ids[0]))
    return out


def test_seeded_generation_same_split_across_prefill_and_decode() -> None:
    params = SamplingParams(temperature=1.5, seed=42, repetition_penalty=1.2)
    one = _generate(params, [1, 2, 3], 12, split=False, filler=0)
    two = _generate(params, [1, 2, 3], 12, split=True, filler=3)
    assert one == two
    other = _generate(SamplingParams(temperature=1.5, seed=43, repetition_penalty=1.2),
                      [1, 2, 3], 12, split=False, filler=0)
    assert other != one


def test_advance_equals_rebuild() -> None:
    params = [SamplingParams(seed=5, frequency_penalty=0.7, min_tokens=2, temperature=0.9),
              SamplingParams(temperature=0, repetition_penalty=1.5)]
    outs: list[list[int]] = [[], [4]]
    batch = SamplingBatch.build(params, [list(o) for o in outs], [[1], [2]], V, "cpu", (0,))
    for step in range(5):
        logits = torch.stack([_toy_logits([step, 0]), _toy_logits([step, 1])])
        fresh = SamplingBatch.build(params, outs, [[1], [2]], V, "cpu", (0,))
        a = SAMPLER.sample(logits, batch).next_token_ids
        b = SAMPLER.sample(logits, fresh).next_token_ids
        assert torch.equal(a, b)
        batch.advance(a)
        outs = [o + [int(t)] for o, t in zip(outs, a)]


def _reference_penalties(logits: torch.Tensor, params: list[SamplingParams],
                         prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    ref = logits.clone()
    for i, p in enumerate(params):
        for tok in set(prompts[i]) | set(outputs[i]):
            v = float(ref[i, tok])
            ref[i, tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok in set(outputs[i]):
            count = outputs[i].count(tok)
            ref[i, tok] -= count * p.frequency_penalty + p.presence_penalty
    return ref


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_penalties_match_slow_reference(data: st.DataObject) -> None:
    rows = data.draw(st.integers(1, 5))
    ids = st.lists(st.integers(0, V - 1), max_size=12)
    prompts = [data.draw(ids) for _ in range(rows)]
    outputs = [data.draw(ids) for _ in range(rows)]
    params = [SamplingParams(repetition_penalty=data.draw(st.floats(0.5, 2.0)),
                             frequency_penalty=data.draw(st.floats(-2.0, 2.0)),
                             presence_penalty=data.draw(st.floats(-2.0, 2.0)))
              for _ in range(rows)]
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(rows))
    batch = SamplingBatch.build(params, outputs, prompts, V, "cpu")
    got = apply_penalties(logits.clone(), batch)
    torch.testing.assert_close(got, _reference_penalties(logits, params, prompts, outputs))
    # Greedy with penalties: exactly the argmax of the penalized logits.
    greedy = [SamplingParams(temperature=0, repetition_penalty=p.repetition_penalty,
                             frequency_penalty=p.frequency_penalty,
                             presence_penalty=p.presence_penalty) for p in params]
    out = sample(logits, greedy, outputs, prompts)
    assert torch.equal(out.next_token_ids, torch.argmax(got, dim=-1))


def _assert_matches(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    n = len(tokens)
    freq = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * n
    keep = expected > 5
    chi2 = float((((freq - expected) ** 2)[keep] / expected[keep]).sum())
    # ~V degrees of freedom; a loose bound that a wrong distribution blows far past.
    assert chi2 < 3 * len(probs) + 30, (chi2, freq, expected)


def test_temperature_sampling_matches_softmax() -> None:
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5])
    temperature = 0.7
    n = 20000
    out = sample(base.repeat(n, 1), [SamplingParams(temperature=temperature)] * n)
    _assert_matches(out.next_token_ids, torch.softmax(base / temperature, dim=-1))


def test_seeded_sampling_matches_softmax_across_seeds() -> None:
    base = torch.tensor([1.0, 0.2, -0.3, 0.8, 0.0, -1.0])
    n = 3000
    out = sample(base.repeat(n, 1), [SamplingParams(temperature=1.0, seed=s) for s in range(n)])
    _assert_matches(out.next_token_ids, torch.softmax(base, dim=-1))


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, V)
    logits[:, 0] = 100.0  # eos
    logits[:, 5] = 90.0  # stop token id
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(5,)),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(5,)),
              SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)]
    out = sample(logits, params, [[1, 1], [1, 1, 1], [1]], eos=(0,))
    # Row 0 has 2 < 3 outputs: both masked; row 1 reached min_tokens; row 2 ignores eos.
    assert out.next_token_ids.tolist()[0] not in (0, 5)
    assert out.next_token_ids.tolist()[1:] == [0, 0]


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.3, repetition_penalty=2.0, logprobs=5),
              SamplingParams(temperature=0, logprobs=0), SamplingParams()]
    out = sample(logits, params, [[1, 2], [], []], [[3], [], []])
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.next_token_ids[:, None])[:, 0])
    top = torch.topk(ref, 5, dim=-1)
    assert torch.equal(out.top_logprob_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)
    only_chosen = sample(logits, [SamplingParams(logprobs=0)] * 3)
    assert only_chosen.logprobs is not None and only_chosen.top_logprob_ids is None


def test_rejects_bad_shapes() -> None:
    batch = SamplingBatch.build([SamplingParams()], [[]], None, V, "cpu")
    with pytest.raises(ValueError, match="^logits:"):
        SAMPLER.sample(torch.zeros(1, V + 1), batch)
    with pytest.raises(ValueError, match="^output_ids:"):
        SamplingBatch.build([SamplingParams()], [[], []], None, V, "cpu")
