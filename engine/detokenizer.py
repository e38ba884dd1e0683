"""Incremental detokenization: token ids in, newly final text out.

Decoding a suffix of a sequence can differ from the matching slice of decoding the whole (leading
spaces of SentencePiece pieces, byte-level tokens that split a UTF-8 character). So each step
decodes a short window `ids[prefix_offset:]` and emits only what it adds beyond
`ids[prefix_offset:read_offset]`, the part already emitted. A window whose text ends in U+FFFD
holds a character that later tokens complete: nothing is emitted and the offsets stay until then.

Invariant: the concatenation of all `add` results and `flush` equals the text the tokenizer gives
for the generated ids (for prompt-free streams: `tokenizer.decode(ids)`).
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context decoded before the first generated one, so that a leading space or a
# character that spans the prompt/output boundary decodes as it would in the whole text.
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What we need from a tokenizer: HF `PreTrainedTokenizerBase` and `tokenizers.Tokenizer`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas; one instance per request."""

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
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
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_ids: list[int]) -> str:
        """Append generated ids; return the text they made final (may be empty)."""
        out = []
        for tid in token_ids:
            self._ids.append(int(tid))
            out.append(self._step())
        delta = "".join(out)
        if delta:
            self._text_parts.append(delta)
        return delta

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
