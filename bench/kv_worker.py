"""The sender process of `pdserve kvbench`: a prefill KVManager that runs whole waves of rooms
on command, so that no pipe round trip sits inside a timed transfer."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from pdserve.bench.kv_peer import PoolSpec, kv_checksum, make_manager
from pdserve.kvtransfer.aux import AuxData
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.manager import KVManager
from pdserve.kvtransfer.poll import KVPoll
from pdserve.kvtransfer.rank_pools import PoolSet


def _run_wave(mgr: KVManager, pools: PoolSet, plan: list[tuple[int, list[int]]],
              chunk_pages: int, timeout_s: float) -> dict[str, Any]:
    senders = [(room, mgr.create_sender(room), src) for room, src in plan]
    t0 = time.monotonic()
    while any(s.poll() < KVPoll.WaitingForInput for _, s, _ in senders):
        if time.monotonic() - t0 > timeout_s:
            break
        time.sleep(0.0005)
    starts: dict[int, float] = {}
    for room, s, src in senders:
        starts[room] = time.monotonic()
        n = len(src)
        for start in range(0, n, chunk_pages):
            end = min(n, start + chunk_pages)
            last = end == n
            s.send(src[start:end], start, last, AuxData(1, -0.5, 0) if last else None)
    while any(s.poll() not in (KVPoll.Success, KVPoll.Failed) for _, s, _ in senders):
        if time.monotonic() - t0 > timeout_s:
            break
        time.sleep(0.002)  # the timing is decode's; a tighter loop only takes CPU from it
    failed = {room: s.failure_reason or str(s.poll()) for room, s, _ in senders
              if s.poll() != KVPoll.Success}
    sums = {room: kv_checksum(pools, src) for room, _, src in senders}
    return {"starts": starts, "failed": failed, "checksums": sums,
            "paths": sorted(set(mgr.transfer_paths().values()))}


def serve(conn: Connection, spec: PoolSpec, cfg: dict[str, Any]) -> None:
    mgr, pools, _ = make_manager("prefill", spec, TransferConfig(**cfg))
    conn.send(mgr.bootstrap_addr)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            plan, chunk_pages, timeout_s = msg
            conn.send(_run_wave(mgr, pools, plan, chunk_pages, timeout_s))
    finally:
        mgr.close()
        conn.send(mgr.registered_regions())


class SenderProcess:
    def __init__(self, spec: PoolSpec, config: TransferConfig) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, spec, asdict(config)), daemon=True)
        self.proc.start()
        child.close()
        if not self._conn.poll(120):
            self.close()
            raise TimeoutError("kvbench sender did not start")
        self.bootstrap_addr: str = self._conn.recv()

    def start_wave(self, plan: list[tuple[int, list[int]]], chunk_pages: int,
                   timeout_s: float) -> None:
        self._conn.send((plan, chunk_pages, timeout_s))

    def wave_result(self, timeout_s: float) -> dict[str, Any]:
        if not self._conn.poll(timeout_s):
            raise TimeoutError("kvbench sender wave timed out")
        return self._conn.recv()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self._conn.send(None)
                if self._conn.poll(30):
                    self._conn.recv()
        finally:
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            self._conn.close()
