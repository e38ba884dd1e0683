"""StopChecker and TextStream: finish reasons, trimming, and no stop-string leaks in streaming."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stop import StopChecker, TextStream

PIECES = ["a", "b", "c", "ab", "bc", "abc", " ", "\n", "\n\n", "END", "E", "N", "D", "xy"]
EOS = len(PIECES)  # decodes to "" when special tokens are skipped


class PieceTokenizer:
    """Each id is a fixed string piece: token boundaries are exactly under test control."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("<eos>" if i == EOS else PIECES[i] for i in ids
                       if not (skip_special_tokens and i == EOS))


def ids_of(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def stream_for(stop: tuple[str, ...] = (), max_tokens: int = 100, min_tokens: int = 0,
               stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False) -> TextStream:
    params = SamplingParams(stop=stop, max_tokens=max_tokens, min_tokens=min_tokens,
                            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    return TextStream.from_params(PieceTokenizer(), params, eos_token_ids=(EOS,))


def run(stream: TextStream, ids: list[int]) -> list[str]:
    deltas = []
    for tid in ids:
        delta, finished, _ = stream.push(tid)
        deltas.append(delta)
        if finished:
            break
    return deltas


def test_check_token_reasons() -> None:
    c = StopChecker(stop_token_ids=(7,), eos_token_ids=(2,), max_tokens=4, min_tokens=1)
    assert c.check_token(2, 2) == "stop" and c.check_token(7, 2) == "stop"
    assert c.check_token(2, 0) is None  # below min_tokens
    assert c.check_token(3, 3) is None and c.check_token(3, 4) == "length"
    assert c.check_token(2, 4) == "stop"  # stop wins over length
    ignoring = StopChecker(eos_token_ids=(2,), ignore_eos=True, max_tokens=4)
    assert ignoring.check_token(2, 1) is None


def test_checker_validation_names_field() -> None:
    with pytest.raises(ValueError, match="^max_tokens:"):
        StopChecker(max_tokens=0)
    with pytest.raises(ValueError, match="^min_tokens:"):
        StopChecker(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="^stop:"):
        StopChecker(stop=("",))


def test_holdback_is_longest_partial_stop_suffix() -> None:
    c = StopChecker(stop=("\n\n", "END"))
    assert c.holdback("abc") == 0
    assert c.holdback("abc\n") == 1
    assert c.holdback("abcEN") == 2
    assert c.holdback("E") == 1
    assert StopChecker().holdback("anything") == 0


def test_stop_string_spanning_tokens_is_trimmed_and_never_leaks() -> None:
    s = stream_for(stop=("END",))
    deltas = run(s, ids_of("a", "b", "E", "N", "c", "E", "N", "D", "xy"))
    # "EN" was held while it could start "END", released when "c" ruled that out.
    assert deltas == ["a", "b", "", "", "ENc", "", "", ""]
    assert s.text == "abENc" and s.finish_reason == "stop" and s.stop_reason == "END"


def test_stop_string_inside_one_token_and_earliest_wins() -> None:
    s = stream_for(stop=("bc", "c"))
    assert run(s, ids_of("a", "abc")) == ["a", "a"]
    assert s.text == "aa" and s.stop_reason == "bc"


def test_eos_and_stop_token_end_without_text() -> None:
    s = stream_for(stop=("\n\n",))
    # The "\n" is held (it may start "\n\n") and released when eos ends the stream.
    assert run(s, ids_of("a", "\n") + [EOS]) == ["a", "", "\n"]
    assert s.finish_reason == "stop" and s.stop_reason == EOS and s.text == "a\n"
    s = stream_for(stop_token_ids=(PIECES.index("xy"),))
    assert run(s, ids_of("a", "xy", "b")) == ["a", ""]
    assert s.text == "a" and s.stop_reason == PIECES.index("xy")


def test_ignore_eos_and_min_tokens() -> None:
    s = stream_for(ignore_eos=True, max_tokens=3)
    assert run(s, [EOS, EOS, EOS]) == ["", "", ""] and s.finish_reason == "length"
    s = stream_for(min_tokens=3, stop=("b",), max_tokens=5)
    run(s, [EOS] + ids_of("b", "a", "b"))  # eos and "b" arrive while below min_tokens
    assert s.text == "ba" and s.finish_reason == "stop" and s.num_output_tokens == 4


def test_length_finish_flushes_held_text() -> None:
    s = stream_for(stop=("END",), max_tokens=3)
    deltas = run(s, ids_of("a", "E", "N"))
    assert deltas == ["a", "", "EN"] and s.finish_reason == "length"
    with pytest.raises(ValueError, match="^token_id:"):
        s.push(0)


def test_push_many_and_abort() -> None:
    s = stream_for(stop=("\n\n",))
    delta, finished, reason = s.push_many(ids_of("a", "\n", "\n", "b"))
    assert (delta, finished, reason) == ("a", True, "stop")
    s = stream_for(stop=("END",))
    assert s.push_many(ids_of("a", "E")) == ("a", False, None)
    assert s.finish() == "E" and s.finish_reason == "abort"


def _reference(ids: list[int], stop: tuple[str, ...], max_tokens: int) -> tuple[str, str]:
    text = ""
    for n, tid in enumerate(ids, start=1):
        if tid == EOS:
            return text, "stop"
        text += PIECES[tid]
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return text[: min(hits)], "stop"
        if n >= max_tokens:
            return text, "length"
    return text, "length"


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, EOS), min_size=1, max_size=30),
       stop=st.lists(st.text(alphabet="abcEND\n x", min_size=1, max_size=4), max_size=3),
       max_tokens=st.integers(1, 30))
def test_streaming_matches_reference_and_never_leaks(ids: list[int], stop: list[str],
                                                     max_tokens: int) -> None:
    s = stream_for(stop=tuple(stop), max_tokens=max_tokens)
    expected_text, expected_reason = _reference(ids, tuple(stop), max_tokens)
    sent = ""
    for tid in ids:
        delta, finished, _ = s.push(tid)
        sent += delta
        # What the client has seen is always a prefix of the final text: nothing retracted.
        assert expected_text.startswith(sent)
        if finished:
            break
    if not s.finished:
        sent += s.finish("length")
    assert sent == expected_text == s.text
    assert s.finish_reason == expected_reason
    assert not any(x in sent for x in stop)


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello 東京 world 😀 stop 🛑 here"] * 10, trainer=trainer)
    return tok


def test_multibyte_stop_string_across_tokens(byte_bpe: Tokenizer) -> None:
    text = "hello 東京 world 🛑 here"
    ids = byte_bpe.encode(text).ids
    stream = TextStream(IncrementalDetokenizer(byte_bpe), StopChecker(stop=("京 w", "🛑")))
    deltas = run(stream, ids)
    assert "".join(deltas) == "hello 東" == stream.text
    assert stream.stop_reason == "京 w"
    assert not any("\ufffd" in d for d in deltas)
    stream = TextStream(IncrementalDetokenizer(byte_bpe), StopChecker(stop=("🛑",)))
    assert "".join(run(stream, ids)) == "hello 東京 world "
