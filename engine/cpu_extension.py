"""Build-once, load-many C++ extensions for the CPU paths, kept in the pdserve cache.

torch's JIT loader (`cpp_extension.load_inline`) guards its shared build directory with a lock
file; a process killed while holding it (a worker stopped mid-start) leaves the file behind and
every later load waits on it forever. So a build here runs in a private temporary directory
and its library is renamed into `<pdserve cache>/cpu_ext/` atomically, and loading is a plain
import of that file, with no lock. Two first builds at once both compile and the last rename
wins (the same bytes). The file name carries a hash of the source, the flags, and the torch and
Python versions, and the host's CPU capability picks the flags, so a stale or foreign build is
never loaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from types import ModuleType

import torch

from pdserve.engine.default_model import cache_dir

log = logging.getLogger(__name__)

_ARCH_FLAGS = {"avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx512f", "-mavx2", "-mfma"]}


def _import(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip `ninja` package (a dependency) puts it
    next to the interpreter, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])


def build_or_load(name: str, source: str, functions: list[str]) -> ModuleType:
    """The compiled module of C++ `source` exposing `functions` (built on first use)."""
    from torch.utils import cpp_extension

    cap = torch.backends.cpu.get_cpu_capability().lower()  # "avx2", "avx512", "default", ...
    cflags = ["-O3", "-fopenmp", *_ARCH_FLAGS.get(cap, [])]
    key = hashlib.sha256("\0".join(
        [source, " ".join(cflags), ",".join(functions), torch.__version__, sys.version]
    ).encode()).hexdigest()[:16]
    mod_name = f"{name}_{cap}_{key}"
    root = os.path.join(cache_dir(), "cpu_ext")
    path = os.path.join(root, mod_name + ".so")
    if os.path.exists(path):
        try:
            return _import(mod_name, path)
        except ImportError as e:  # a damaged file: build it again below
            log.warning("rebuilding %s: %r", path, e)
    os.makedirs(root, exist_ok=True)
    _ninja_on_path()
    tmp = tempfile.mkdtemp(prefix=mod_name + ".", dir=root)
    try:
        module = cpp_extension.load_inline(
            name=mod_name, cpp_sources=source, functions=functions, extra_cflags=cflags,
            extra_ldflags=["-fopenmp"], build_directory=tmp, verbose=False)
        built = os.path.join(tmp, mod_name + ".so")
        os.chmod(built, 0o755)
        os.replace(built, path)  # the loaded mapping survives the rename
        module.__file__ = path  # where the library is now (its build directory goes next)
        return module
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class BackgroundBuild:
    """One build per process. `get(block=False)` never waits: it starts the build on a thread
    and returns None until it is done; `get(block=True)` waits. None for good when the build
    failed (no compiler, say; logged once): callers keep their torch path."""

    def __init__(self, what: str, build: Callable[[], ModuleType]) -> None:
        self._what = what
        self._build = build
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self.module: ModuleType | None = None
        self.error: str | None = None

    def _run(self) -> None:
        try:
            self.module = self._build()
        except Exception as e:
            self.error = repr(e)
            log.warning("%s unavailable, using torch ops: %r", self._what, e)
        finally:
            self._done.set()

    def get(self, block: bool) -> ModuleType | None:
        if not self._done.is_set():
            with self._lock:
                if self._thread is None:
                    # The builder's imports (setuptools, packaging) happen here, not on the
                    # thread: a module imported on two threads at once can be seen half made
                    # (`cannot import name 'version' from 'packaging'` while the caller's
                    # thread loaded a model).
                    from torch.utils import cpp_extension  # noqa: F401
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name=f"build {self._what}")
                    self._thread.start()
            if block:
                self._done.wait()
        return self.module
