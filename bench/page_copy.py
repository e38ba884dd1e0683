"""Page-to-page copy between two GPUs (kernels/page_p2p_copy.py, launched on either GPU, and one
torch copy per page) against the torch peer-copy ceiling measured in the same run. Needs two
CUDA devices with peer access.

Pools on cuda:0 and cuda:1 in the Llama-3-8B page shape (`[pages, 32, 2, 16, 8, 128]` bf16,
2 MiB a page); a request's pages drawn at random from the pools (as after churn) or contiguous.
With `--ipc` the destination pool is allocated by a child process and mapped here through its
CUDA IPC handle, as the cuda_ipc transfer backend sees it (the kernel on the source GPU is
refused there: only the destination GPU reaches that mapping). Prints one JSON line per
variant and a table.

    python -m pdserve.bench.page_copy [--tokens 4096] [--pool-pages 4097] [--iters 20] [--ipc]
"""

from __future__ import annotations

import argparse
import json

import torch

from pdserve.kernels.page_p2p_copy import PageCopier
from pdserve.kvtransfer.backends.cuda_ipc import enable_peer_access


def _child_pool(q, done, pages: int, shape: tuple) -> None:  # noqa: ANN001
    pool = torch.zeros(pages, *shape, device="cuda:1", dtype=torch.bfloat16)
    q.put(pool)
    done.wait()


def _time(fn, iters: int, device: int = 0) -> float:
    """Median milliseconds of fn over iters runs (CUDA events on `device`'s current stream)."""
    fn()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(torch.cuda.current_stream(device))
        fn()
        b.record(torch.cuda.current_stream(device))
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _variants(src, dst, sp, dp):  # noqa: ANN001, ANN202
    """The shipped kernel on each GPU, and one torch copy per page."""
    push = PageCopier(src, dst)  # on the source GPU: remote writes
    pull = PageCopier(src, dst, device=dst.device)  # on the destination GPU: remote reads
    si, di, si1, di1 = sp.cuda(0), dp.cuda(0), sp.cuda(1), dp.cuda(1)
    pairs = list(zip(sp.tolist(), dp.tolist()))

    def on_dst() -> None:
        with torch.cuda.device(1):
            pull(si1, di1)
    return {"page_p2p_copy on the source GPU": lambda: push(si, di),
            "page_p2p_copy on the destination GPU": on_dst,
            "per-page copy_": lambda: [dst[b].copy_(src[a], non_blocking=True)
                                       for a, b in pairs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--pool-pages", type=int, default=4097)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ipc", action="store_true", help="destination pool from another process")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_page_copy: needs two CUDA devices")
    shape = (32, 2, 16, 8, 128)
    src = torch.randn(args.pool_pages, *shape, device="cuda:0").to(torch.bfloat16)
    torch.cuda.set_device(0)
    # For peer copies at NVLink speed and for the kernel on either GPU to reach the other's
    # native pool. An IPC-mapped pool stays unreachable from the source GPU's kernels.
    enable_peer_access(0, 1)
    if args.ipc:
        ctx = torch.multiprocessing.get_context("spawn")
        q, done = ctx.Queue(), ctx.Event()
        child = ctx.Process(target=_child_pool, args=(q, done, args.pool_pages, shape),
                            daemon=True)
        child.start()
        dst = q.get()
    else:
        dst = torch.zeros(args.pool_pages, *shape, device="cuda:1", dtype=torch.bfloat16)
    n = args.tokens // 16
    page_bytes = src[0].numel() * 2
    nbytes = n * page_bytes
    flat_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    flat_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    ceiling_ms = _time(lambda: flat_b.copy_(flat_a, non_blocking=True), args.iters)
    ceiling = nbytes / ceiling_ms / 1e6
    g = torch.Generator().manual_seed(0)
    layouts = {
        "random": (torch.randperm(args.pool_pages - 1, generator=g)[:n] + 1,
                   torch.randperm(args.pool_pages - 1, generator=g)[:n] + 1),
        "contiguous": (torch.arange(1, n + 1), torch.arange(1, n + 1)),
    }
    rows = [{"variant": "peer copy (ceiling)", "layout": "-", "ms": round(ceiling_ms, 3),
             "gbps": round(ceiling, 1), "ratio": 1.0}]
    for layout, (sp, dp) in layouts.items():
        variants = _variants(src, dst, sp, dp)
        for name, fn in variants.items():
            dst.zero_()
            print(f"timing {name} ({layout})", flush=True)
            try:
                ms = _time(fn, args.iters, 1 if "destination" in name else 0)
            except (RuntimeError, ValueError) as e:
                print(json.dumps({"variant": name, "layout": layout, "refused": str(e)[:120]}))
                continue
            ok = torch.equal(dst[dp.cuda(1)], src[sp.cuda(0)].to("cuda:1"))
            gbps = nbytes / ms / 1e6
            row = {"variant": name, "layout": layout, "ms": round(ms, 3),
                   "gbps": round(gbps, 1), "ratio": round(gbps / ceiling, 3), "exact": ok}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.ipc:
        done.set()
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    print(f"\n{nbytes / 2**20:.0f} MiB per request, {n} pages of {page_bytes >> 20} MiB")
    for r in sorted(rows, key=lambda r: (r["layout"], r["ms"]))[:40]:
        print(f"{r['layout']:>10}  {r['variant']:<34} {r['ms']:7.3f} ms {r['gbps']:7.1f} GB/s "
              f"{r['ratio']:.3f}")


if __name__ == "__main__":
    main()
