"""Prefill next to decode on one GPU: how much each slows the other, per way of sharing it.

    python3 -P -m pdserve.bench.gpu_spatial [--modes alone,streams,green,mps,timesliced]
        [--prefill-share 0.5] [--batch 32] [--context 2048] [--prompt 2048] [--seconds 5]

The Llama-3-8B shape with random weights: a decode loop (CUDA graph at batch `--batch`, every
sequence at `--context` tokens, at most two steps queued, as the serving loop runs) and a
prefill loop (one `--prompt`-token sequence per pass) run at the same time for `--seconds`:
- `alone`: each loop by itself on the whole GPU (the baselines);
- `streams`: one process, two threads on two streams, no split;
- `green`: one process, each thread in a green context of its share of the SMs (the decode
  graph captured in its own), one KV pool would serve both: design (b);
- `mps`: two processes as MPS clients at the shares' active-thread percentages: design (a),
  `pdserve up --spatial`;
- `timesliced`: the same two processes without MPS (today's `pdserve up` on one GPU).
Reports, per mode, decode step p50/p99 and prefill pass p50 under load, each loop's rate
against its `alone` rate, and the GPU work done per second: decode steps/s over the alone rate
plus prefill passes/s over theirs (1.0 = one GPU's worth, time-sliced ideally; above 1 the
sharing makes the two overlap). Each mode runs on its own; a failure is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

CHILD_TIMEOUT_S = 300.0  # model build (FlashInfer JIT on a bare machine) plus the timed loop


def build(role: str, args: argparse.Namespace, model=None):  # noqa: ANN001, ANN202
    """(model, one pass) for `role`: a decode step replayed from a CUDA graph, or a prefill."""
    from pdserve.bench.gpu_bench import make_backend
    from pdserve.bench.gpu_harness import PagedSeqs, llama3_8b_config, random_model
    from pdserve.engine.cuda_graph import CudaGraphDecodeRunner
    from pdserve.engine.kv_pool import KVPool

    cfg = llama3_8b_config()
    model = model if model is not None else random_model(cfg)
    backend = make_backend("flashinfer", cfg)
    if role == "decode":
        pages = args.batch * (-(-(args.context + 8) // 16)) + 64
        pool = KVPool(pages, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                      torch.bfloat16, "cuda")
        seqs = PagedSeqs(pool, backend, seed=1)
        seqs.pretend_context(args.batch, args.context - 1)
        fb = seqs.batch([[7] for _ in range(args.batch)])
        runner = CudaGraphDecodeRunner(model, pool, backend, args.batch)
        runner.capture()
        return model, lambda: runner.replay(fb)
    pool = KVPool(-(-args.prompt // 16) + 64, cfg.num_layers, 16, cfg.num_kv_heads,
                  cfg.head_dim, torch.bfloat16, "cuda")
    seqs = PagedSeqs(pool, backend, seed=2)
    seqs.reset(1)
    fb = seqs.batch([list(range(args.prompt))])

    def prefill() -> None:
        backend.init_forward(fb)
        model(fb)

    return model, prefill


@torch.inference_mode()
def loop(one: Callable[[], object], seconds: float) -> list[float]:
    """Pass periods (ms) on the current stream, at most two passes queued."""
    stream = torch.cuda.current_stream()
    for _ in range(3):
        one()
    stream.synchronize()
    marks: list[torch.cuda.Event] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        marks.append(e)
        one()
        if len(marks) > 2:
            marks[-3].synchronize()
    last = torch.cuda.Event(enable_timing=True)
    last.record(stream)
    last.synchronize()
    marks.append(last)
    return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])][1:]


_GREEN: list = []  # the green contexts made, alive while their streams run


def _green_stream(share: float | None):  # noqa: ANN202
    """A stream of a green context holding `share` of the SMs (made current for this thread);
    the default stream's context when `share` is None."""
    if share is None:
        return torch.cuda.Stream()
    from torch.cuda.green_contexts import GreenContext

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    num = max(8, int(sms * share) // 8 * 8)  # partitions come in SM groups
    ctx = GreenContext.create(num_sms=num, device_id=0)
    _GREEN.append(ctx)  # its destructor destroys the context: kept for the process's life
    ctx.set_context()
    # CUDA graphs are captured on a side stream made once per process: make it again, here,
    # so the decode graph is captured in this green context (only this thread captures).
    torch.cuda.graphs.graph.default_capture_stream = None
    return ctx.Stream() if hasattr(ctx, "Stream") else torch.cuda.Stream()


def _random_model():  # noqa: ANN202
    from pdserve.bench.gpu_harness import llama3_8b_config, random_model

    return random_model(llama3_8b_config())


def alone(args: argparse.Namespace) -> dict:
    model = _random_model()
    return {role: loop(build(role, args, model)[1], args.seconds)
            for role in ("decode", "prefill")}


def in_process(args: argparse.Namespace, shares: dict[str, float] | None) -> dict:
    """Both loops in one process on two threads (green contexts when `shares`)."""
    results: dict[str, list[float]] = {}
    errors: list[str] = []
    ready = threading.Barrier(2)
    model = _random_model()  # one copy of the weights, as one worker process would hold
    torch.cuda.graphs.graph.default_capture_stream = None  # see _green_stream

    def run(role: str) -> None:
        try:
            stream = _green_stream(shares[role] if shares else None)
            with torch.cuda.stream(stream):
                _, one = build(role, args, model)  # decode: its graph captured in its context
                ready.wait(timeout=600)
                results[role] = loop(one, args.seconds)
        except Exception:  # noqa: BLE001 - reported in the table
            errors.append(f"{role}: {traceback.format_exc(limit=3)}")
            ready.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in ("decode", "prefill")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return results


def _read_until(p: subprocess.Popen, accept: Callable[[str], bool], what: str) -> str:
    """The first stdout line of `p` that `accept`s (libraries may print before it)."""
    for line in p.stdout:  # type: ignore[union-attr]
        if accept(line.strip()):
            return line.strip()
    raise RuntimeError(f"{what}: the process exited ({p.wait()}) first")


def two_processes(args: argparse.Namespace, env: dict[str, dict[str, str]]) -> dict:
    """Each loop in its own process (env per role); they start together once both are built."""
    procs = {role: subprocess.Popen(
        # -P: the cwd (a checkout whose bare pdserve/ would shadow the installed package) stays
        # off the path, as for the parent (scripts/gpu-check)
        [sys.executable, "-P", "-m", "pdserve.bench.gpu_spatial", "--role", role,
         "--seconds", str(args.seconds), "--batch", str(args.batch), "--context",
         str(args.context), "--prompt", str(args.prompt)],
        env={**os.environ, **env[role]}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True) for role in ("decode", "prefill")}
    watchdog = threading.Timer(CHILD_TIMEOUT_S, lambda: [p.kill() for p in procs.values()])
    watchdog.start()
    try:
        for role, p in procs.items():
            _read_until(p, lambda x: x == "ready", role)
        for p in procs.values():
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        return {role: json.loads(_read_until(p, lambda x: x.startswith("["), role))
                for role, p in procs.items()}
    finally:
        watchdog.cancel()
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def child(args: argparse.Namespace) -> int:
    _, one = build(args.role, args)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    print(json.dumps(loop(one, args.seconds)), flush=True)
    return 0


def summarize(periods: dict[str, list[float]], base: dict[str, float] | None) -> dict:
    out: dict[str, float] = {}
    for role, ms in periods.items():
        if not ms:
            raise RuntimeError(f"{role}: no pass completed")
        q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [ms[0]] * 99
        out[f"{role}_p50_ms"] = statistics.median(ms)
        out[f"{role}_p99_ms"] = q[98]
        out[f"{role}_per_s"] = 1000.0 / statistics.fmean(ms)
    if base:
        out["work"] = sum(out[f"{r}_per_s"] / base[f"{r}_per_s"] for r in ("decode", "prefill"))
    return out


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    share = {"prefill": args.prefill_share, "decode": round(1 - args.prefill_share, 4)}
    if mode == "alone":
        return alone(args)
    if mode == "streams":
        return in_process(args, None)
    if mode == "green":
        return in_process(args, share)
    if mode == "timesliced":
        return two_processes(args, {"decode": {}, "prefill": {}})
    if mode == "mps":
        from pdserve.spatial import BINARY, MpsDaemon
        from pdserve.worker.sm_share import PCT_ENV, percentage

        binary = shutil.which(BINARY)
        if binary is None:
            raise RuntimeError(f"{BINARY} is not on PATH")
        daemon = MpsDaemon.running(binary) or MpsDaemon.start(binary)
        try:
            env = {r: {**daemon.env, PCT_ENV: str(percentage(v))} for r, v in share.items()}
            return two_processes(args, env)
        finally:
            daemon.stop()
    raise ValueError(f"modes: unknown {mode!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="alone,streams,green,mps,timesliced")
    p.add_argument("--prefill-share", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--role", choices=("decode", "prefill"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        return child(args)
    rows: dict[str, dict | str] = {}
    base: dict[str, float] | None = None
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        try:
            rows[mode] = summarize(run_mode(mode, args), base)
            if mode == "alone":
                base = rows[mode]  # type: ignore[assignment]
        except Exception as e:  # noqa: BLE001 - the next mode still runs
            rows[mode] = f"failed: {type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        torch.cuda.empty_cache()
        print(json.dumps({"mode": mode, "result": rows[mode]}), flush=True)
    print(f"== prefill {args.prompt} tokens next to decode batch {args.batch} at {args.context} "
          f"tokens; shares prefill/decode {args.prefill_share:g}/{1 - args.prefill_share:g}")
    print(f"{'mode':<12}{'dec p50':>9}{'dec p99':>9}{'dec/s':>8}{'pre p50':>9}{'pre/s':>7}"
          f"{'dec x':>7}{'pre x':>7}{'work':>7}")
    for mode, r in rows.items():
        if isinstance(r, str):
            print(f"{mode:<12}{r}")
            continue
        rel = [r[f"{k}_per_s"] / base[f"{k}_per_s"] if base else 0.0
               for k in ("decode", "prefill")]
        print(f"{mode:<12}{r['decode_p50_ms']:>9.2f}{r['decode_p99_ms']:>9.2f}"
              f"{r['decode_per_s']:>8.1f}{r['prefill_p50_ms']:>9.1f}{r['prefill_per_s']:>7.1f}"
              f"{rel[0]:>7.2f}{rel[1]:>7.2f}{r.get('work', 0.0):>7.2f}")
    return 0 if all(not isinstance(r, str) for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
