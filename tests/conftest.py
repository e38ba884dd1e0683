"""Session-wide fixtures: a tiny random HF model and the embedded default SmolLM2 GGUF; and
`pdserve_env`, which sets PDSERVE_* switches for one test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fixtures.tiny_model import write_tiny_model

from pdserve.envs import envs


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build (or import) the CPU decode kernel once, before any test starts worker processes,
    so they import the cached build instead of compiling it side by side."""
    from pdserve.engine.attention import cpu_decode

    cpu_decode.load(block=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama in HF format (config.json, model.safetensors, tokenizer)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF (downloaded into the pdserve cache once)."""
    from pdserve.engine.default_model import default_model_path

    return default_model_path()


@pytest.fixture
def pdserve_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str | None], None]]:
    """`pdserve_env(name, value)` sets (None: unsets) a variable for this test and makes
    `envs()` read the environment again, now and once the test is over."""

    def set_env(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        envs.cache_clear()

    yield set_env
    envs.cache_clear()
