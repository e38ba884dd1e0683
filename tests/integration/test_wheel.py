"""The built wheel holds every module of every top-level folder, under `pdserve.<folder>`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("router", "prefill", "decode", "kvtransfer", "kernels", "engine", "proto", "bench",
           "worker", "pdserve")


def _expected() -> set[str]:
    names = set()
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder)
            prefix = "pdserve" if folder == "pdserve" else f"pdserve/{folder}"
            names.add(f"{prefix}/{rel.as_posix()}")
    return names


def test_wheel_contains_every_module(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, timeout=300)
    wheels = list(tmp_path.glob("pdserve-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        inside = set(zf.namelist())
    missing = sorted(_expected() - inside)
    assert not missing, f"modules missing from the wheel (add their packages): {missing}"
    assert "pdserve/proto/pdserve.proto" in inside
    assert not any(n.startswith(("kernels/", "engine/", "router/", "bench/")) for n in inside), \
        "bare top-level module names would collide with other packages"
