"""IncrementalDetokenizer against tokenizers trained here on multi-byte text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji time 😀🎉🚀 and families 👨‍👩‍👧 with flags 🇫🇷 and é à ü ß ñ.",
    "Mixed: 数学 math 🧮 123 + 456 = 579 ✅ café naïve façade",
] * 20
ALPHABET = "abc xyz.,!\n é東京日本首都😀🎉🚀👨‍👩‍👧🇫🇷ßñ✅"
EOS = "<eos>"


def _train(pre: pre_tokenizers.PreTokenizer, dec: decoders.Decoder, alphabet: list[str],
           vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None if alphabet else "<unk>"))
    tok.pre_tokenizer = pre
    tok.decoder = dec
    special = [EOS] if alphabet else [EOS, "<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    # Small vocab: most CJK characters and emoji stay split across several byte tokens.
    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                  pre_tokenizers.ByteLevel.alphabet(), 300)


@pytest.fixture(scope="module")
def metaspace_bpe() -> Tokenizer:
    # SentencePiece-style: decoding a window drops the leading "▁" space of its first piece.
    return _train(pre_tokenizers.Metaspace(), decoders.Metaspace(), [], 400)


def _stream(tok, ids: list[int], chunk: int = 1, prompt: list[int] | None = None,
            skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def test_multibyte_characters_span_tokens(byte_bpe: Tokenizer) -> None:
    text = "東京 😀🎉 👨‍👩‍👧 🇫🇷 ok"
    ids = byte_bpe.encode(text).ids
    assert len(ids) > len(text)  # characters really are split over several tokens
    deltas = _stream(byte_bpe, ids)
    assert "".join(deltas) == byte_bpe.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # everything was final before the flush


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40), chunk=st.integers(1, 4))
def test_byte_level_deltas_concatenate_to_decode(byte_bpe: Tokenizer, text: str,
                                                 chunk: int) -> None:
    ids = byte_bpe.encode(text).ids
    deltas = _stream(byte_bpe, ids, chunk)
    assert "".join(deltas) == byte_bpe.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet="abc xyz.é東京😀", min_size=1, max_size=40))
def test_metaspace_suffix_decode_differs_but_stream_matches(metaspace_bpe: Tokenizer,
                                                            text: str) -> None:
    ids = metaspace_bpe.encode(text).ids
    deltas = _stream(metaspace_bpe, ids)
    assert "".join(deltas) == metaspace_bpe.decode(ids)


def test_metaspace_window_really_differs(metaspace_bpe: Tokenizer) -> None:
    ids = metaspace_bpe.encode("hello world").ids
    pieces = "".join(metaspace_bpe.decode([i]) for i in ids)
    assert pieces != metaspace_bpe.decode(ids)  # naive per-token decode would lose spaces
    assert "".join(_stream(metaspace_bpe, ids)) == "hello world"


@settings(max_examples=40, deadline=None)
@given(prompt=st.text(alphabet=ALPHABET, max_size=20),
       output=st.text(alphabet=ALPHABET, min_size=1, max_size=20))
def test_with_prompt_emits_only_the_continuation(byte_bpe: Tokenizer, prompt: str,
                                                 output: str) -> None:
    prompt_ids = byte_bpe.encode(prompt).ids
    out_ids = byte_bpe.encode(output).ids
    deltas = _stream(byte_bpe, out_ids, prompt=prompt_ids)
    assert "".join(deltas) == output
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(byte_bpe: Tokenizer) -> None:
    eos = byte_bpe.token_to_id(EOS)
    ids = byte_bpe.encode("ab 東").ids + [eos] + byte_bpe.encode("c").ids
    assert "".join(_stream(byte_bpe, ids)) == "ab 東c"
    assert "".join(_stream(byte_bpe, ids, skip=False)) == byte_bpe.decode(
        ids, skip_special_tokens=False)


def test_incomplete_character_held_until_flush(byte_bpe: Tokenizer) -> None:
    emoji_ids = byte_bpe.encode("😀").ids
    assert len(emoji_ids) > 1
    detok = IncrementalDetokenizer(byte_bpe)
    assert detok.add(byte_bpe.encode("hi").ids) == "hi"
    assert detok.add(emoji_ids[:-1]) == ""  # the character is not complete yet
    assert detok.flush() == "\ufffd"  # truncated stream: the tail is emitted as decode does
    assert detok.token_ids == byte_bpe.encode("hi").ids + emoji_ids[:-1]


def test_hf_fast_tokenizer_wrapper(byte_bpe: Tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=byte_bpe, eos_token=EOS,
                                 clean_up_tokenization_spaces=False)
    text = "Hello 東京 🚀 world."
    ids = hf.encode(text, add_special_tokens=False) + [hf.eos_token_id]
    deltas = _stream(hf, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
