"""The tokenizer a model is served with: which files make one, and ids past its vocabulary.

A model with random weights (`--load-format dummy`) may have a larger vocabulary than the
tokenizer it is served with (the Llama-3-8B shape's 128,256 ids against SmolLM2's 49,152). Its
output ids are as meaningless as its text, but every one of them must decode to some text, as a
real model's would, so that streams carry one piece of text per token and the serving path does
the work it does for a real model: `FoldedVocab` decodes an id the tokenizer lacks as
`id % len(tokenizer)` and reports the model's vocabulary as its length (prompt ids are checked
against it). Real checkpoints are never folded: an id they emit past their tokenizer (padding
rows of the output head) decodes to no text, as transformers decodes it.

Imports neither torch nor transformers: the router uses it.
"""

from __future__ import annotations

import json
import os
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer_files(path: str) -> bool:
    """`path` is a directory holding an HF tokenizer (with or without a model)."""
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES)


def config_vocab_size(model_dir: str) -> int | None:
    """The vocab_size of `model_dir`'s config.json, None when there is none."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class FoldedVocab:
    """A tokenizer serving a model whose ids run past its own vocabulary (see the module
    docstring); everything but `decode` and `len` is the wrapped tokenizer's."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.model_vocab_size = vocab_size
        self._size = len(tokenizer)

    def __len__(self) -> int:
        return self.model_vocab_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def fold(self, ids: list[int]) -> list[int]:
        n = self._size
        return [i % n if i >= n else i for i in ids]

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(self.fold([ids] if isinstance(ids, int) else list(ids)),
                                     *args, **kwargs)


def fold_vocab(tokenizer: Any, vocab_size: int | None) -> Any:
    """`tokenizer`, wrapped in FoldedVocab when the model's `vocab_size` exceeds it."""
    if vocab_size is None or vocab_size <= len(tokenizer):
        return tokenizer
    return FoldedVocab(tokenizer, vocab_size)
