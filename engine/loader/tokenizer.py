"""Tokenizers for HF directories and GGUF files, with converted GGUF tokenizers cached.

transformers rebuilds a GGUF file's tokenizer (vocab, merges, chat template) from its metadata,
which takes seconds; the router and every worker need it at start. The converted tokenizer is
saved once in HF format under the pdserve cache, keyed by file name, size and mtime, and read
from there afterwards (milliseconds).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any


def _cache_key(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.basename(path)}-{st.st_size}-{st.st_mtime_ns}"


def load_hf_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_gguf_tokenizer(path: str, cache_root: str | None = None) -> Any:
    from transformers import AutoTokenizer

    from pdserve.engine.default_model import cache_dir

    cached = os.path.join(cache_root or cache_dir(), "tokenizers", _cache_key(path))
    if os.path.isdir(cached):
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                        gguf_file=os.path.basename(path))
    # Best effort: a read-only or full cache only costs the conversion next time.
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached), prefix=".tok-")
        try:
            tok.save_pretrained(tmp)
            os.rename(tmp, cached)  # atomic; fails if a concurrent process got there first
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok
