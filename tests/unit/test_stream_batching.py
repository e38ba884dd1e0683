"""The serving path's shortcuts against their plain references: tokens batched into fewer
messages give the same text and finish; text chunks written from a prefix are json.dumps'
bytes; the backend decoder is the tokenizer's decode; worker events cross threads in order."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fixtures.tiny_model import write_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.engine.detokenizer import IncrementalDetokenizer, decode_fn
from pdserve.engine.served_tokenizer import fold_vocab
from pdserve.engine.stop import StopChecker, TextStream
from pdserve.router import openai_format as fmt
from pdserve.router.errors import RouterError, UpstreamFailed
from pdserve.router.events import FlowEvent
from pdserve.router.fanout import FanOut
from pdserve.router.http.sse import TextChunks, _data
from pdserve.router.metrics import CountedHistogram
from pdserve.worker.events import EventPump, ReqChannel, TokenOutput, TokensEvent

EOS = 0


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    # A small vocab keeps CJK characters and emoji split across byte tokens.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Hello world, 東京 and 😀🎉 café"] * 20, trainer=trainer)
    return tok


def _stream(tok: Tokenizer, max_tokens: int, stop_ids: tuple[int, ...]) -> TextStream:
    checker = StopChecker(stop_token_ids=stop_ids, eos_token_ids=(EOS,), max_tokens=max_tokens)
    return TextStream(IncrementalDetokenizer(tok, prompt_ids=[5, 6]), checker)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 299), min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 6), min_size=1, max_size=40),
       max_tokens=st.integers(1, 45), stop_id=st.integers(1, 299))
def test_tokens_in_batches_give_the_text_of_one_by_one(byte_bpe: Tokenizer, ids: list[int],
                                                       cuts: list[int], max_tokens: int,
                                                       stop_id: int) -> None:
    one = _stream(byte_bpe, max_tokens, (stop_id,))
    for tid in ids:
        if one.push(tid)[1]:
            break
    many = _stream(byte_bpe, max_tokens, (stop_id,))
    sent, pos, k = "", 0, 0
    while pos < len(ids) and not many.finished:
        n = cuts[k % len(cuts)]
        sent += many.push_many(ids[pos:pos + n])[0]
        assert one.text.startswith(sent)  # nothing sent that the one-by-one text lacks
        pos, k = pos + n, k + 1
    if not one.finished:
        one.finish("length")
    if not many.finished:
        sent += many.finish("length")
    assert sent == many.text == one.text
    assert (many.finish_reason, many.num_output_tokens) == (one.finish_reason,
                                                            one.num_output_tokens)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=20), index=st.integers(0, 9), chat=st.booleans(),
       reason=st.sampled_from([None, "stop", "length", "abort"]),
       rid=st.text(min_size=1, max_size=12), model=st.text(min_size=1, max_size=12))
def test_text_chunks_are_json_dumps_bytes(text: str, index: int, chat: bool, reason: str | None,
                                          rid: str, model: str) -> None:
    event = FlowEvent(request_id="r", text=text, finish_reason=reason)
    if chat:
        delta = {"content": text} if text else {}
        want = _data(fmt.chat_chunk(rid, 1234, model, index, delta, event, False))
    else:
        choice = fmt.ChoiceState(index=index, counts_prompt=True)
        want = _data(fmt.completion_chunk(rid, 1234, model, choice, event, False))
    assert TextChunks(rid, 1234, model, chat).chunk(index, text, reason) == want
    json.loads(want[len("data: "):])


@pytest.mark.parametrize("chat", [False, True])
def test_an_event_is_one_line_for_splitlines_readers(chat: bool) -> None:
    """U+0085, U+2028 and U+2029 survive json.dumps unescaped, and httpx's aiter_lines (which
    splits as str.splitlines) cut such an event in two: they are escaped."""
    text = "a\x85b\u2028c\u2029d\ne\x1cf"
    fast = TextChunks("r\u2028", 1, "m\x85", chat).chunk(0, text, None)
    event = FlowEvent(request_id="r", text=text)
    if chat:
        slow = _data(fmt.chat_chunk("r\u2028", 1, "m\x85", 0, {"content": text}, event, False))
    else:
        choice = fmt.ChoiceState(index=0, counts_prompt=True)
        slow = _data(fmt.completion_chunk("r\u2028", 1, "m\x85", choice, event, False))
    assert fast == slow
    lines = fast.splitlines()
    assert len(lines) == 2 and lines[1] == ""
    obj = json.loads(lines[0][len("data: "):])
    got = obj["choices"][0]["delta"]["content"] if chat else obj["choices"][0]["text"]
    assert got == text and obj["id"] == "r\u2028" and obj["model"] == "m\x85"


def test_backend_decode_is_the_tokenizers_decode(tmp_path) -> None:
    from transformers import AutoTokenizer

    write_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    fast = decode_fn(tok)
    for ids in ([], [1, 2, 3], list(range(len(tok))), [0, 5, 1, 200, 2, 33]):
        for skip in (True, False):
            assert fast(ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    folded = fold_vocab(tok, len(tok) * 3)
    fast = decode_fn(folded)
    ids = [7, len(tok) + 7, 2 * len(tok) + 1]
    assert fast(ids, True) == tok.decode([7, 7, 1], skip_special_tokens=True)


async def test_events_cross_threads_in_order_in_batches() -> None:
    pump = EventPump(asyncio.get_running_loop())
    flushes = 0
    plain_flush = pump._flush

    def counted() -> None:
        nonlocal flushes
        flushes += 1
        plain_flush()

    pump._flush = counted  # type: ignore[method-assign]
    chans = [ReqChannel(pump) for _ in range(8)]

    def scheduler() -> None:  # a step puts one token per request, 50 steps
        for step in range(50):
            for c in chans:
                c.put(TokensEvent(TokenOutput([step])))

    thread = threading.Thread(target=scheduler)
    thread.start()
    got: list[list[int]] = [[] for _ in chans]
    while any(len(g) < 50 for g in got):
        for i, c in enumerate(chans):
            if len(got[i]) < 50:
                batch = await c.get_batch()
                got[i] += [t for ev in batch for t in ev.tokens.token_ids]
    thread.join()
    assert got == [list(range(50))] * 8
    assert flushes < 400  # far fewer wake-ups than events


async def test_hand_over_waits_for_the_loop_to_take_the_events() -> None:
    """A first token's hand-over returns once the loop has delivered what was posted (the
    scheduler thread blocked meanwhile); with nothing pending it returns at once; a loop that
    does not run costs the poster at most the timeout."""
    loop = asyncio.get_running_loop()
    pump = EventPump(loop)
    chan = ReqChannel(pump)
    seen: list[tuple[int, float]] = []  # (events delivered when hand_over returned, seconds)

    def scheduler(timeout_s: float) -> None:
        t0 = time.perf_counter()
        pump.hand_over(timeout_s)  # nothing posted
        assert time.perf_counter() - t0 < 0.05
        chan.put(TokensEvent(TokenOutput([1])))
        t0 = time.perf_counter()
        pump.hand_over(timeout_s)
        seen.append((len(chan._items), time.perf_counter() - t0))

    thread = threading.Thread(target=scheduler, args=(5.0,))
    thread.start()
    while thread.is_alive():
        await asyncio.sleep(0.001)
    assert seen[0][0] == 1 and seen[0][1] < 5.0  # delivered before the wait ended
    assert (await chan.get_batch())[0].tokens.token_ids == [1]

    seen.clear()
    thread = threading.Thread(target=scheduler, args=(0.05,))
    thread.start()
    thread.join()  # the loop is held here: the flush cannot run
    assert seen[0][0] == 0 and 0.04 < seen[0][1] < 1.0
    assert (await chan.get_batch())[0].tokens.token_ids == [1]  # still delivered, later


def test_token_outputs_concatenate() -> None:
    a = TokenOutput([1, 2], [-0.1, -0.2], [([1, 3], [-0.1, -2.0]), ([2, 4], [-0.2, -3.0])])
    b = TokenOutput([5], [-0.5], [([5, 6], [-0.5, -1.0])])
    c = TokenOutput.concat([a, b])
    assert c.token_ids == [1, 2, 5] and c.logprobs == [-0.1, -0.2, -0.5]
    assert c.top_logprobs[2] == ([5, 6], [-0.5, -1.0])
    assert TokenOutput.concat([a]) is a


def test_counted_histogram_matches_repeated_observations() -> None:
    buckets = (0.001, 0.01, 0.1, 1.0)
    ours = CountedHistogram("x_seconds", "x", buckets)
    reg = CollectorRegistry()
    ref = Histogram("x_seconds", "x", buckets=buckets, registry=reg)
    for value, count in ((0.0005, 3), (0.01, 2), (0.5, 1), (7.0, 4), (0.001, 1)):
        ours.observe(value, count)
        for _ in range(count):
            ref.observe(value)
    mine = CollectorRegistry()
    mine.register(ours)

    def lines(r: CollectorRegistry) -> list[str]:
        return [ln for ln in generate_latest(r).decode().splitlines()
                if ln.startswith("x_seconds_") and "_created" not in ln]

    assert lines(mine) == lines(reg)


def test_stream_interval_is_validated() -> None:
    from pdserve.engine.config import SchedulerConfig

    with pytest.raises(ValueError, match="stream_interval"):
        SchedulerConfig(stream_interval=0)


async def _flow(n: int, error: Exception | None = None, closed: list | None = None):
    try:
        for i in range(n):
            await asyncio.sleep(0.01)
            yield FlowEvent(request_id="r", text=str(i))
        if error is not None:
            raise error
    finally:
        if closed is not None:
            closed.append(True)


async def test_a_single_flow_read_in_place() -> None:
    fan = FanOut([_flow(3)])
    await fan.prime()
    assert [e.text for _, e in [x async for x in fan.events()]] == ["0", "1", "2"]
    await fan.close()
    fan = FanOut([_flow(0, UpstreamFailed("gone", code="worker_failed"))])
    with pytest.raises(UpstreamFailed, match="gone"):
        await fan.prime()  # an error before any output: the HTTP status
    fan = FanOut([_flow(2, ValueError("bug"))])
    await fan.prime()
    with pytest.raises(RouterError, match="internal error: ValueError"):
        async for _ in fan.events():
            pass
    closed: list = []
    fan = FanOut([_flow(100, closed=closed)])
    await fan.prime()

    async def drain() -> None:
        async for _ in fan.events():
            pass

    task = asyncio.ensure_future(drain())
    await asyncio.sleep(0.05)
    task.cancel()  # as a client that went away: the flow unwinds in the reading task
    await fan.close()  # while that task still runs the flow: no error
    await asyncio.gather(task, return_exceptions=True)
    await fan.close()
    assert closed == [True]
