"""pdserve/envs.py: typed parsing, errors that name the variable, the documented tables, and no
`PDSERVE_*` name in the tree that the module does not declare."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pdserve.envs import DEPLOY_VARIABLES, Envs, envs, markdown_tables, read_envs, switches

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bPDSERVE_[A-Z0-9_]+")
SKIP_DIRS = {".git", ".venv", "__pycache__", "build", "dist", ".device", ".pytest_cache",
             ".ruff_cache", ".hypothesis", "out", "img", "proto"}


def _source_files() -> list[Path]:
    """The repository's text files (no virtualenv, caches, build output, images, protobuf)."""
    out = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [Path(top, n) for n in names if not n.endswith((".png", ".svg", ".pyc", ".so"))]
    return out


def test_defaults_when_unset_or_empty() -> None:
    assert read_envs({}) == Envs()
    assert read_envs({"PDSERVE_FUSED_OPS": "", "PDSERVE_CACHE": " "}) == Envs()
    assert Envs().fused_ops and not Envs().kv_trace and Envs().cache is None


@pytest.mark.parametrize("raw,value", [("1", True), ("true", True), ("ON", True), ("yes", True),
                                       ("0", False), ("false", False), ("Off", False),
                                       ("no", False)])
def test_boolean_spellings(raw: str, value: bool) -> None:
    assert read_envs({"PDSERVE_DECODE_GEMV": raw}).decode_gemv is value


def test_typed_values() -> None:
    e = read_envs({"PDSERVE_SOAK_CLIENTS": "32", "PDSERVE_SOAK_SECONDS": "2.5",
                   "PDSERVE_CACHE": "/tmp/c", "PDSERVE_KV_TRACE": "1"})
    assert (e.soak_clients, e.soak_seconds, e.cache, e.kv_trace) == (32, 2.5, "/tmp/c", True)


@pytest.mark.parametrize("name,raw", [("PDSERVE_PDL", "maybe"), ("PDSERVE_SOAK_CLIENTS", "many"),
                                      ("PDSERVE_SOAK_CLIENTS", "1.5"),
                                      ("PDSERVE_SOAK_SECONDS", "-3")])
def test_unparsable_value_names_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ValueError, match=name):
        read_envs({name: raw})


def test_read_once_until_rebuilt(pdserve_env) -> None:  # noqa: ANN001
    pdserve_env("PDSERVE_SOAK_CLIENTS", "7")
    assert envs().soak_clients == 7
    assert envs() is envs()


def test_cli_refuses_a_malformed_switch(pdserve_env, capsys) -> None:  # noqa: ANN001
    from pdserve.cli import main

    pdserve_env("PDSERVE_FUSED_OPS", "sometimes")
    assert main(["kvtrace", "/nonexistent"]) == 2
    assert "PDSERVE_FUSED_OPS" in capsys.readouterr().err


def test_docs_carry_the_generated_tables() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert markdown_tables() in doc, "regenerate with `python3 -m pdserve.envs`"


def test_every_pdserve_variable_in_the_tree_is_declared() -> None:
    declared = {f.metadata["env"] for f in switches()} | set(DEPLOY_VARIABLES)
    found: dict[str, str] = {}
    for path in _source_files():
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    unknown = {name: rel for name, rel in found.items() if name not in declared}
    assert not unknown, f"declare these in pdserve/envs.py: {unknown}"


def test_only_envs_reads_pdserve_variables() -> None:
    """Python code reads switches through envs(), never os.environ / os.getenv directly."""
    direct = re.compile(r"(environ\.get|environ\[|getenv)\(?\s*[\"']PDSERVE_")
    offenders = [str(p.relative_to(ROOT)) for p in _source_files()
                 if p.suffix == ".py" and p.name != "envs.py"
                 and direct.search(p.read_text(errors="replace"))]
    assert not offenders
