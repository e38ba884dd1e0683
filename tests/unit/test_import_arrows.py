"""Imports between the top-level folders point one way (README, "Layout").

Every `import pdserve.<folder>` / `from pdserve.<folder> import ...` in the product's code,
function-level imports included, must follow an arrow of ALLOWED; the checker is also run on a
copy of the tree with a wrong-way import planted, which it must report.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("proto", "kernels", "engine", "kvtransfer", "worker", "prefill", "decode", "router",
           "bench")

# importer -> the folders it may import (besides itself and the leaf module pdserve.envs).
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "engine": {"kernels"},
    "proto": {"engine"},  # rpc.py converts engine's SamplingParams
    "kvtransfer": {"kernels"},
    "worker": {"engine", "proto"},
    "prefill": {"worker", "engine", "kvtransfer", "proto"},
    "decode": {"worker", "engine", "kvtransfer", "proto"},
    "router": {"engine", "proto"},
    "bench": set(FOLDERS) | {"pdserve"},
    # the CLI and `pdserve up` start any component
    "pdserve": set(FOLDERS),
}
# Importable from anywhere; they import no other pdserve module.
LEAVES = {"pdserve.envs", "pdserve.pauses", "pdserve.trace_log"}


def _folder_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "pdserve":
        return None
    if len(parts) == 1 or parts[1] not in FOLDERS:
        return "pdserve"
    return parts[1]


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pdserve":  # `from pdserve import envs`
                out += [(node.lineno, f"pdserve.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def violations(sources: dict[str, str]) -> list[str]:
    """`sources`: path relative to the repository root -> source. Returns one line per import
    against the arrows."""
    bad = []
    for rel, src in sorted(sources.items()):
        top = rel.split("/")[0]
        importer = top if top in FOLDERS else "pdserve"
        module_name = "pdserve." + rel.removesuffix(".py").replace("/", ".").removeprefix(
            "pdserve.")
        for line, name in _imports(ast.parse(src, rel)):
            target = _folder_of(name)
            if target is None or target == importer:
                if module_name in LEAVES and target is not None:
                    bad.append(f"{rel}:{line}: the leaf {module_name} imports {name}")
                continue
            if any(name == leaf or name.startswith(leaf + ".") for leaf in LEAVES):
                continue
            if target not in ALLOWED[importer]:
                bad.append(f"{rel}:{line}: {importer} -> {target} ({name})")
    return bad


def _product_sources() -> dict[str, str]:
    out = {}
    for folder in (*FOLDERS, "pdserve"):
        for path in (ROOT / folder).rglob("*.py"):
            out[path.relative_to(ROOT).as_posix()] = path.read_text()
    return out


def test_imports_follow_the_arrows() -> None:
    assert violations(_product_sources()) == []


def test_a_planted_wrong_way_import_is_reported() -> None:
    sources = _product_sources()
    sources["engine/scheduler.py"] += "\n\ndef _f():\n    from pdserve.router import core\n"
    sources["kvtransfer/poll.py"] += "\nimport pdserve.engine.req\n"
    sources["worker/events.py"] += "\nfrom pdserve.decode.scheduler import DecodeReq\n"
    found = violations(sources)
    assert any(v.startswith("engine/scheduler.py") and "engine -> router" in v for v in found)
    assert any("kvtransfer -> engine" in v for v in found)
    assert any("worker -> decode" in v for v in found)
    assert len(found) == 3, found
