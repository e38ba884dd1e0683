"""Incremental detokenization: token ids in, newly final text out.

Decoding a suffix of a sequence can differ from the matching slice of decoding the whole (leading
spaces of SentencePiece pieces, byte-level tokens that split a UTF-8 character). So each step
decodes a short window `ids[prefix_offset:]` and emits only what it adds beyond
`ids[prefix_offset:read_offset]`, the part already emitted. A window whose text ends in U+FFFD
holds a character that later tokens complete: nothing is emitted and the offsets stay until then.

Several ids at once (a stream that fell behind catches up in one message) decode as one window
when it ends in a whole character: one step instead of one per id, the same text in total.

Invariant: the concatenation of all `add` results and `flush` equals the text the tokenizer gives
for the generated ids (for prompt-free streams: `tokenizer.decode(ids)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pdserve.engine.served_tokenizer import FoldedVocab

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context decoded before the first generated one, so that a leading space or a
# character that spans the prompt/output boundary decodes as it would in the whole text.
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What we need from a tokenizer: HF `PreTrainedTokenizerBase` and `tokenizers.Tokenizer`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


DecodeFn = Callable[[list[int], bool], str]


def decode_fn(tokenizer: Any) -> DecodeFn:
    """`tokenizer.decode(ids, skip_special_tokens=...)` as a function, going straight to the Rust
    `tokenizers` backend of a transformers fast tokenizer when the two agree (it cleans up no
    tokenization spaces): the wrapper costs ~3 us a call, the backend ~1, and a stream decodes
    twice per token."""
    if isinstance(tokenizer, FoldedVocab):
        inner, fold = decode_fn(tokenizer.tokenizer), tokenizer.fold
        return lambda ids, skip: inner(fold(ids), skip)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None  # noqa: N806
        if Tokenizer is not None and isinstance(backend, Tokenizer):
            return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas; one instance per request."""

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._decode_ids = decode_fn(tokenizer)
        self._skip_special = skip_special_tokens
        context = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._num_context = len(context)
        # The window starts inside the prompt context; a context that begins mid-character
        # decodes with a leading U+FFFD in both texts of the diff, which cancels out.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text_parts: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """Generated ids seen so far (without the prompt context)."""
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self._skip_special)

    def add(self, token_ids: list[int]) -> str:
        """Append generated ids; return the text they made final (may be empty)."""
        if len(token_ids) > 1:
            delta = self._step_many(token_ids)
            if delta is not None:
                if delta:
                    self._text_parts.append(delta)
                return delta
        out = []
        for tid in token_ids:
            self._ids.append(int(tid))
            out.append(self._step())
        delta = "".join(out)
        if delta:
            self._text_parts.append(delta)
        return delta

    def _step_many(self, token_ids: list[int]) -> str | None:
        """All of `token_ids` as one step; None (nothing changed) when the window would end in
        an incomplete character, so that one-by-one steps emit what is complete of it."""
        start = len(self._ids)
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if new_text.endswith(REPLACEMENT_CHAR):
            del self._ids[start:]
            return None
        if len(new_text) <= len(prefix_text):  # only skipped special tokens so far
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _step(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Either nothing visible yet (special token skipped, partial character) or a
            # character is still incomplete: wait for more ids.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        if delta:
            self._text_parts.append(delta)
        return delta
