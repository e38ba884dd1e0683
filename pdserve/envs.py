"""Every `PDSERVE_*` environment switch of the Python code, typed, with its default and what it
does; read once per process.

`envs()` parses the environment on its first call and returns the same frozen `Envs` after
that, so a switch cannot change under a running process and a malformed value fails at start-up
(`pdserve` calls it before any subcommand) with a ValueError naming the variable. Tests that set
a variable rebuild the instance with `envs.cache_clear()` (or call `read_envs(mapping)`).

This module imports nothing from pdserve: kernels/, engine/ and kvtransfer/ all read it.

Switches that code and tests flip at run time are not environment state: the fused-kernel
choices belong to the model (`engine/models/fused.Fusion`, seeded from here), FlashInfer's
decode choice to its backend (`flashinfer_decode_only`), PDL per launch (`gemv(pdl=...)`).
Variables the deploy manifests expand into command-line flags are not read by Python and are
listed in DEPLOY_VARIABLES. `python3 -m pdserve.envs` prints the tables in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"{name}: {raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _number(kind: type) -> Callable[[str, str], Any]:
    def parse(name: str, raw: str) -> Any:
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"{name}: {raw!r} is not {'an' if kind is int else 'a'} "
                             f"{kind.__name__}") from None
        if value <= 0:
            raise ValueError(f"{name}: must be > 0, got {raw!r}")
        return value
    return parse


def _text(name: str, raw: str) -> str:
    return raw


def _switch(env: str, default: Any, parse: Callable[[str, str], Any], doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"env": env, "parse": parse, "doc": doc})


@dataclasses.dataclass(frozen=True)
class Envs:
    """The switches; an unset or empty variable takes the default."""

    # Model execution on CUDA (engine/models/fused.py, kernels/, engine/attention/).
    fused_ops: bool = _switch(
        "PDSERVE_FUSED_OPS", True, _flag,
        "Triton kernels for RMSNorm + residual, RoPE and SiLU-mul on CUDA; off: plain torch")
    decode_gemv: bool = _switch(
        "PDSERVE_DECODE_GEMV", True, _flag,
        "a batch-1 decode step through the fused GEMV kernels (kernels/gemv.py)")
    gemm_silu: bool = _switch(
        "PDSERVE_GEMM_SILU", True, _flag,
        "the MLP's gate_up GEMM with SiLU-mul in its epilogue (Hopper+, 64+ rows)")
    rope_store: bool = _switch(
        "PDSERVE_ROPE_STORE", True, _flag,
        "a decode step's RoPE and KV store as one kernel")
    residual_gemm: bool = _switch(
        "PDSERVE_RESIDUAL_GEMM", True, _flag,
        "residual adds inside o_proj / down_proj's GEMMs; off: fused into the next RMSNorm")
    pdl: bool = _switch(
        "PDSERVE_PDL", True, _flag,
        "programmatic dependent launch of our Triton kernels (Hopper+)")
    flashinfer_decode: bool = _switch(
        "PDSERVE_FLASHINFER_DECODE", False, _flag,
        "the flashinfer backend runs every decode batch with FlashInfer, never our Triton kernels")
    # KV transfer.
    ucx_rma: bool = _switch(
        "PDSERVE_UCX_RMA", True, _flag,
        "a decode worker's ucx engine maps its pool for one-sided puts; off: its prefill peers "
        "send staged tagged messages (kvtransfer/backends/ucx_put.py)")
    ucx_mapped: bool = _switch(
        "PDSERVE_UCX_MAPPED", True, _flag,
        "a ucx sender whose peer's GPU pool UCX maps onto its own GPU (ucp_rkey_ptr) copies a "
        "chunk's pages with one kernel; off: one put per run of pages "
        "(kvtransfer/backends/ucx_put.py)")
    # Diagnostics and storage.
    kv_trace: bool = _switch(
        "PDSERVE_KV_TRACE", False, _flag,
        "`kvtrace <stage> <room> <time>` lines on stderr per KV transfer (`pdserve kvtrace LOG`)")
    req_trace: bool = _switch(
        "PDSERVE_REQ_TRACE", False, _flag,
        "`reqtrace <stage> <request id> <time>` lines on stderr at each hop of a request "
        "(`pdserve reqtrace LOG`)")
    step_trace: str | None = _switch(
        "PDSERVE_STEP_TRACE", None, _text,
        "a folder: every scheduler (offline engine, each worker) writes one JSON line per "
        "forward step to `steps-<pid>-<id>.jsonl` there (`python -m pdserve.bench.step_trace`)")
    kernel_profile: str | None = _switch(
        "PDSERVE_KERNEL_PROFILE", None, _text,
        "a folder: every scheduler profiles its long extend batches (torch.profiler) and writes "
        "the time per kernel to `kernels-<pid>-<id>.jsonl` there (`python -m "
        "pdserve.bench.kernel_profile`)")
    cache: str | None = _switch(
        "PDSERVE_CACHE", None, _text,
        "cache folder (default model, tokenizers, CPU kernel); unset: $XDG_CACHE_HOME/pdserve "
        "or ~/.cache/pdserve")
    # Process lifetime.
    launcher_fd: int | None = _switch(
        "PDSERVE_LAUNCHER_FD", None, _number(int),
        "set by `pdserve up` in the processes it starts: a pipe that reads end-of-file once the "
        "launcher is gone, however it died; the process then stops (pdserve/child.py)")
    # Tests.
    skip_flashinfer: bool = _switch(
        "PDSERVE_SKIP_FLASHINFER", False, _flag,
        "tests/gpu skip the FlashInfer cases (`scripts/gpu-check --skip-flashinfer` sets it)")
    soak: bool = _switch(
        "PDSERVE_SOAK", False, _flag,
        "run the long soak test (`make soak` sets it)")
    soak_seconds: float = _switch(
        "PDSERVE_SOAK_SECONDS", 180.0, _number(float),
        "how long the long soak test drives load, in seconds")
    soak_clients: int = _switch(
        "PDSERVE_SOAK_CLIENTS", 256, _number(int),
        "concurrent clients of the long soak test")


# Set in deploy/k8s (ConfigMap and Secret) and expanded by Kubernetes into the containers'
# command-line flags, or by the Dockerfile; pdserve's Python code never reads them.
DEPLOY_VARIABLES: dict[str, str] = {
    "PDSERVE_MODEL": "`--model` of every pod (ConfigMap; the image bakes the default model)",
    "PDSERVE_SERVED_MODEL_NAME": "the router's `--served-model-name` (ConfigMap)",
    "PDSERVE_ROUTER_ADDR": "workers' `--router`: the router Service's gRPC address (ConfigMap)",
    "PDSERVE_TRANSFER_BACKEND": "workers' `--transfer-backend` (ConfigMap)",
    "PDSERVE_LOG_LEVEL": "`--log-level` of every pod (ConfigMap)",
    "PDSERVE_TP": "a worker pod's `--tp`, equal to its GPUs (container env; overlays/tp)",
    "PDSERVE_API_KEY": "the router's `--api-key` (Secret)",
    "PDSERVE_REGISTRATION_SECRET": "`--registration-secret` of every pod (Secret)",
}


def switches() -> list[dataclasses.Field]:
    return list(dataclasses.fields(Envs))


def read_envs(environ: Mapping[str, str]) -> Envs:
    """An Envs from `environ`; ValueError naming the variable for a value that does not parse."""
    values = {}
    for f in switches():
        raw = environ.get(f.metadata["env"], "").strip()
        if raw:
            values[f.name] = f.metadata["parse"](f.metadata["env"], raw)
    return Envs(**values)


@functools.cache
def envs() -> Envs:
    """The process's switches, read from os.environ on the first call."""
    return read_envs(os.environ)


def markdown_tables() -> str:
    """The switches and the deploy variables as the Markdown tables of docs/configuration.md
    (a test compares them)."""
    rows = ["| Variable | Default | What it does |", "|---|---|---|"]
    for f in switches():
        default = "unset" if f.default is None else (
            ("1" if f.default else "0") if isinstance(f.default, bool) else str(f.default))
        rows.append(f"| `{f.metadata['env']}` | {default} | {f.metadata['doc']} |")
    rows += ["", "| Deploy variable | Becomes |", "|---|---|"]
    rows += [f"| `{name}` | {doc} |" for name, doc in DEPLOY_VARIABLES.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_tables())
