"""`pdserve kvbench`: KV page transfer between two processes with model-shaped pools.

This process is the receiver (decode); a spawned child is the sender (prefill). Each request's
pages are drawn at random from the pool (as after churn) or contiguous. Per configuration it
prints GB/s, per-request latency p50/p99 (from the sender's first send() to the moment decode's
room reached Success), descriptors per request, the raw ceiling measured in the same run
(memcpy between host buffers, torch peer copy between two GPUs, or a copy within the one GPU
both processes share) and the ratio; the receiver checks a checksum of every page that arrived.
The first row of each backend also gives the first room to the new peer (`first ms`, to set
against the later rooms' p50) and the handshake before it (`bootstrap_ms`); UCX_TLS, when set,
is recorded with every row.

`--prefill-tp A --decode-tp B`: each side holds one pool per tensor-parallel rank (heads split
as the engine splits them) and every decode rank receives its heads of each page. Such a run
measures the homogeneous case (B ranks on both sides) right after, with the same settings, and
prints the heterogeneous rows' bandwidth as a ratio of it (`vs homog`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from pdserve.bench.kv_peer import PoolSpec, kv_checksum, make_manager
from pdserve.bench.kv_worker import SenderProcess
from pdserve.engine.model_shapes import kv_shape, shape_names
from pdserve.kvtransfer.backends import LANE_BACKENDS, available_backends
from pdserve.kvtransfer.config import IPC_COPIES, TransferConfig
from pdserve.kvtransfer.descriptors import merge_runs
from pdserve.kvtransfer.poll import KVPoll

# (num_layers, num_kv_heads, head_dim) of the shapes that `--model-shape` serves.
MODEL_SHAPES = {name: kv_shape(name) for name in shape_names()}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve kvbench", description=__doc__.split("\n")[0])
    p.add_argument("--model-shape", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    p.add_argument("--layers", type=int, help="override the model shape's layer count")
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=_ints, default=[4096], help="tokens per request, e.g. 512,4096")
    p.add_argument("--page-size", type=_ints, default=[16])
    p.add_argument("--backend", default="", help="comma list; default: every available one")
    p.add_argument("--concurrency", type=_ints, default=[1])
    p.add_argument("--layout", default="random,contiguous", help="random,contiguous")
    p.add_argument("--requests", type=int, default=16, help="timed requests per configuration")
    p.add_argument("--chunk-tokens", type=int, default=0, help="chunked sends (0: one chunk)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--ipc-copy", default="auto", choices=list(IPC_COPIES),
                   help="cuda_ipc: Triton page-to-page kernel, or gather/peer copy/scatter")
    p.add_argument("--stage-mib", type=int, default=0,
                   help="ucx: MiB per staged message (0: the backend's default)")
    p.add_argument("--prefill-tp", type=int, default=1, help="sender's tensor-parallel ranks")
    p.add_argument("--decode-tp", type=int, default=1, help="receiver's tensor-parallel ranks")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    return p.parse_args(argv)


def _devices(device: str) -> tuple[str, str]:
    """(sender, receiver) devices: two GPUs when there are, else both processes on one."""
    if device != "cuda":
        return "cpu", "cpu"
    return "cuda:0", "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"


def memcpy_ceiling_gbps(nbytes: int, device: str, reps: int = 5) -> float:
    """Raw copy between two buffers of one request's size: host memcpy, GPU peer copy, or a
    device-to-device copy on one GPU."""
    if device == "cuda":
        src, dst = _devices(device)
        a = torch.empty(nbytes, dtype=torch.uint8, device=src)
        b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
        sync = torch.cuda.synchronize
    else:
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.empty(nbytes, dtype=torch.uint8)
        sync = None  # type: ignore[assignment]
    best = math.inf
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        b.copy_(a)
        if sync is not None:
            sync(a.device)
            sync(b.device)
        best = min(best, time.perf_counter() - t0)
    if sync is None:  # host: the faster of torch's copy and a plain memcpy (numpy)
        an, bn = a.numpy(), b.numpy()
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            np.copyto(bn, an)
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _pick_pages(rng: random.Random, free: list[int], n: int, layout: str) -> list[int]:
    if layout == "contiguous":
        start = free[0]
        out = list(range(start, start + n))
    else:
        out = rng.sample(free, n)
    taken = set(out)
    free[:] = [p for p in free if p not in taken]
    return out


def run_pair(args: argparse.Namespace, backend: str, page_size: int, bar: tqdm,
             tp: tuple[int, int] = (1, 1)) -> list[dict]:
    """Rows of one (backend, page size) pair of processes; `tp`: (prefill, decode) ranks."""
    layers, heads, head_dim = MODEL_SHAPES[args.model_shape]
    layers, heads = args.layers or layers, args.kv_heads or heads
    head_dim = args.head_dim or head_dim
    max_pages = max(math.ceil(t / page_size) for t in args.tokens) * max(args.concurrency)
    num_pages = 2 * max_pages + 1  # room for random placement; page 0 reserved
    src_dev, dst_dev = _devices(args.device)
    base = {"num_pages": num_pages, "num_layers": layers, "page_size": page_size,
            "num_kv_heads": heads, "head_dim": head_dim, "dtype": args.dtype,
            "model": args.model_shape}
    src_spec = PoolSpec(**base, seed=0, device=src_dev, tp=tp[0])  # type: ignore
    dst_spec = PoolSpec(**base, shm=backend == "shm", device=dst_dev, tp=tp[1])  # type: ignore
    cfg = TransferConfig(backend=backend, transfer_timeout_s=120, waiting_timeout_s=120,
                         ipc_copy=args.ipc_copy, stage_bytes=args.stage_mib << 20)
    sender = SenderProcess(src_spec, cfg)
    mgr, pools, shms = make_manager("decode", dst_spec, cfg)
    rows: list[dict] = []
    rng = random.Random(0)
    room = rng.getrandbits(62)
    first: dict[str, float] = {}  # the pair's first room: to a peer never seen before
    try:
        for tokens in args.tokens:
            n_pages = math.ceil(tokens / page_size)
            nbytes = n_pages * src_spec.page_bytes
            ceiling = memcpy_ceiling_gbps(nbytes, args.device)
            for layout in args.layout.split(","):
                for conc in args.concurrency:
                    lat: list[float] = []
                    descs: list[int] = []
                    ok, moved, elapsed = True, 0, 0.0
                    waves = 1 + max(1, args.requests // conc)  # the first is warm-up
                    for w in range(waves):
                        src_free = list(range(1, num_pages))
                        dst_free = list(range(1, num_pages))
                        plan, receivers = [], []
                        for _ in range(conc):
                            room += 1
                            first.setdefault("created", time.monotonic())
                            src = _pick_pages(rng, src_free, n_pages, layout)
                            dst = _pick_pages(rng, dst_free, n_pages, layout)
                            descs.append(len(merge_runs(
                                src, dst, max_pages=max(1, (8 << 20) // src_spec.page_bytes))))
                            r = mgr.create_receiver(room, sender.bootstrap_addr)
                            r.init(dst)
                            plan.append((room, src))
                            receivers.append((room, r, dst))
                        chunk = (math.ceil(args.chunk_tokens / page_size) if args.chunk_tokens
                                 else n_pages)
                        sender.start_wave(plan, chunk, 120.0)
                        done: dict[int, float] = {}
                        while len(done) < len(receivers):
                            for rm, r, _ in receivers:
                                if rm not in done and r.poll() in (KVPoll.Success,
                                                                   KVPoll.Failed):
                                    done[rm] = r.state.since  # when the room reached it
                            time.sleep(0.002)
                        res = sender.wave_result(180.0)
                        if "room" not in first:
                            rm = receivers[0][0]
                            first.update(room=rm, ms=(done[rm] - res["starts"][rm]) * 1e3,
                                         bootstrap_ms=(res["starts"][rm] - first["created"])
                                         * 1e3)
                        for rm, r, dst in receivers:
                            good = (r.poll() == KVPoll.Success
                                    and kv_checksum(pools, dst) == res["checksums"][rm])
                            ok = ok and good
                        if w == 0:
                            continue
                        t0 = min(res["starts"].values())
                        elapsed += max(done.values()) - t0
                        moved += nbytes * conc
                        lat += [(done[rm] - res["starts"][rm]) * 1e3 for rm, _, _ in receivers]
                        bar.update(1)
                    gbps = moved / elapsed / 1e9 if elapsed else 0.0
                    lat.sort()
                    rows.append({
                        "backend": backend, "tp": f"{tp[0]}->{tp[1]}", "layout": layout,
                        "tokens": tokens,
                        "page_size": page_size, "concurrency": conc,
                        "bytes_per_request": nbytes, "descs_per_request": statistics.mean(descs),
                        "gbps": round(gbps, 3), "ceiling_gbps": round(ceiling, 3),
                        "ratio": round(gbps / ceiling, 3) if ceiling else 0.0,
                        "p50_ms": round(lat[len(lat) // 2], 3),
                        "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
                        "checksum_ok": ok, "model_shape": args.model_shape,
                        "device": args.device, "devices": f"{src_dev}->{dst_dev}",
                        "first_ms": None if rows else round(first["ms"], 3),
                        "bootstrap_ms": None if rows else round(first["bootstrap_ms"], 3),
                        "ucx_tls": os.environ.get("UCX_TLS", ""),
                        "ucx_env": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                            if k.startswith("UCX_")),
                        "stage_mib": args.stage_mib,
                        "ucx_puts": backend == "ucx" and _ucx_puts(),
                        "paths": ",".join(res.get("paths", [])),
                    })
    finally:
        mgr.close()
        sender.close()
        for shm in shms:
            shm.close()
    return rows


def _ucx_puts() -> bool:
    """Whether this process (the receiver) offers ucx senders one-sided puts."""
    from pdserve.kvtransfer.backends.ucx_put import receiver_offers

    return receiver_offers()


def against_homogeneous(hetero: list[dict], homog: list[dict]) -> list[dict]:
    """`vs_homog` on each heterogeneous row: its GB/s over the homogeneous row of the same
    settings."""
    key = ("backend", "layout", "tokens", "page_size", "concurrency")
    base = {tuple(r[k] for k in key): r["gbps"] for r in homog}
    for r in hetero:
        g = base.get(tuple(r[k] for k in key))
        r["vs_homog"] = round(r["gbps"] / g, 3) if g else None
    return hetero


def format_table(rows: list[dict]) -> str:
    cols = [("backend", "backend"), ("tp", "tp"), ("layout", "layout"), ("tokens", "tokens"),
            ("page_size", "page"), ("concurrency", "conc"), ("descs_per_request", "desc/req"),
            ("gbps", "GB/s"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
            ("first_ms", "first ms"), ("ceiling_gbps", "ceiling GB/s"), ("ratio", "ratio"),
            ("vs_homog", "vs homog"), ("checksum_ok", "check")]
    table = [[h for _, h in cols]]
    for r in rows:
        table.append([f"{r[k]:.1f}" if k == "descs_per_request" else
                      "-" if r.get(k) is None else str(r[k]) for k, _ in cols])
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    avail = available_backends()
    if args.device == "cuda":
        avail = [b for b in avail if b != "shm"]
    else:
        avail = [b for b in avail if b != "cuda_ipc"]
    tp = (args.prefill_tp, args.decode_tp)
    if min(tp) < 1:
        print("kvbench: --prefill-tp / --decode-tp: must be at least 1", file=sys.stderr)
        return 2
    heads = args.kv_heads or MODEL_SHAPES[args.model_shape][1]
    for n in tp:
        if heads % n and n % heads:
            print(f"kvbench: {n} tensor-parallel ranks cannot split {heads} KV heads (one must "
                  "divide the other)", file=sys.stderr)
            return 2
    if tp != (1, 1):  # several pools on a side: only the backends that write lanes
        avail = [b for b in avail if b in LANE_BACKENDS]
    backends = [b for b in args.backend.split(",") if b] or avail
    for b in backends:
        if b not in avail:
            print(f"kvbench: backend {b!r} is not available here ({avail})", file=sys.stderr)
            return 2
    homog = (tp[1], tp[1]) if tp[0] != tp[1] else None
    total = ((1 + (homog is not None)) * len(backends) * len(args.page_size) * len(args.tokens)
             * len(args.layout.split(",")) * sum(max(1, args.requests // c)
                                                  for c in args.concurrency))
    rows: list[dict[str, Any]] = []
    with tqdm(total=total, desc="kvbench", unit="wave", file=sys.stderr) as bar:
        for backend in backends:
            for page_size in args.page_size:
                got = run_pair(args, backend, page_size, bar, tp)
                if homog is not None:
                    base = run_pair(args, backend, page_size, bar, homog)
                    got = against_homogeneous(got, base) + base
                rows += got
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(format_table(rows))
    return 0 if all(r["checksum_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
