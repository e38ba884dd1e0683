"""A KVManager in a child process, driven over a pipe: the second process of the integration
tests and of `pdserve kvbench`.

`PeerProcess(role, pool_spec, config)` spawns the child (multiprocessing "spawn", so it shares
nothing with the parent but the pipe) and `call(op, *args)` runs one operation there.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import time
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from pdserve.engine.tp.layout import kv_heads_of
from pdserve.kvtransfer.aux import AuxData
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.fingerprint import Fingerprint
from pdserve.kvtransfer.lanes import KVLayout
from pdserve.kvtransfer.manager import KVManager
from pdserve.kvtransfer.poll import KVPoll
from pdserve.kvtransfer.rank_pools import PoolSet, ipc_handle
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer


@dataclass(frozen=True)
class PoolSpec:
    num_pages: int
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    seed: int | None = None  # random content from this seed; None = zeros
    shm: bool = False  # allocate in shared memory (decode side of the shm backend)
    device: str = "cpu"
    model: str = "test-model"
    tp: int = 1  # tensor-parallel ranks: one pool each, heads split as engine/tp/layout.py does

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the whole KV (every head); rank r's pool holds layout.ranks[r]."""
        return (self.num_pages, self.num_layers, 2, self.page_size, self.num_kv_heads,
                self.head_dim)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.num_kv_heads, tuple(kv_heads_of(self.num_kv_heads, self.tp, r)
                                                 for r in range(self.tp)))

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of every head (what a transfer moves per page, over the ranks)."""
        return (self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim
                * torch.empty((), dtype=getattr(torch, self.dtype)).element_size())

    def fingerprint(self) -> Fingerprint:
        ranks = self.layout.ranks if self.tp > 1 else ()
        return Fingerprint(self.model, self.num_layers, self.num_kv_heads, self.head_dim,
                           self.page_size, self.dtype, kv_ranks=ranks)


def make_pool(spec: PoolSpec) -> tuple[torch.Tensor, ShmPoolBuffer | None]:
    """The pool tensor for a spec (random from its seed, bit-reproducible) and its shm owner;
    with tensor-parallel ranks, rank 0's (make_pools has them all)."""
    pools, shms = make_pools(spec)
    return pools.tensors[0], shms[0] if shms else None


def make_pools(spec: PoolSpec) -> tuple[PoolSet, list[ShmPoolBuffer]]:
    """Every rank's pool (each holding its heads of the same random content, whatever the
    TP size) and the shm owners."""
    dtype = getattr(torch, spec.dtype)
    tensors, shms = [], []
    for _, heads in spec.layout.ranks:
        shape = (*spec.shape[:4], heads, spec.head_dim)
        shm = ShmPoolBuffer(shape, dtype) if spec.shm else None
        pool = shm.tensor if shm is not None else torch.zeros(shape, dtype=dtype,
                                                              device=spec.device)
        if shm is not None:
            pool.zero_()  # touch every page once (a live pool is resident)
            shms.append(shm)
        tensors.append(pool)
    if spec.seed is not None:
        g = torch.Generator().manual_seed(spec.seed)
        # Fill page by page: no full-size temporary.
        for i in range(spec.num_pages):
            page = torch.randn(spec.shape[1:], generator=g).to(dtype)
            for pool, (start, heads) in zip(tensors, spec.layout.ranks):
                pool[i].copy_(page[..., start:start + heads, :])
    if shms:
        handles = tuple(b.name for b in shms)
    elif spec.device.startswith("cuda"):
        handles = tuple(ipc_handle(t) for t in tensors)
    else:
        handles = ("",) * spec.tp
    return PoolSet(tuple(tensors), handles, spec.layout), shms


def kv_checksum(pools: PoolSet, pages: list[int]) -> int:
    """page_checksum of the pages' whole KV (every head, from the first rank holding it),
    the same for any TP layout holding the same KV."""
    if pools.layout.tp == 1:
        return page_checksum(pools.tensors[0], pages)
    idx = torch.as_tensor(pages, dtype=torch.int64)
    whole = torch.empty((len(pages), *pools.tensors[0].shape[1:4], pools.layout.num_kv_heads,
                         pools.tensors[0].shape[5]), dtype=pools.tensors[0].dtype)
    for pool, (start, heads) in zip(pools.tensors, pools.layout.ranks):
        whole[..., start:start + heads, :] = pool[idx.to(pool.device)].cpu()
    return page_checksum(whole, list(range(len(pages))))


def page_checksum(pool: torch.Tensor, pages: list[int]) -> int:
    """Order-sensitive checksum of the given pages' bytes (per page, the sum of its int16
    words)."""
    words = pool.reshape(pool.shape[0], -1).view(torch.int16)
    if pool.device.type == "cpu":  # numpy sums in place; torch would widen a copy first
        flat = words.numpy()
        sums = [int(flat[p].sum(dtype=np.int64)) for p in pages]
    else:
        idx = torch.as_tensor(pages, dtype=torch.int64, device=pool.device)
        sums = words[idx].to(torch.int64).sum(dim=1).tolist()
    total = 0
    for k, s in enumerate(sums):
        total = (total * 1000003 + s + k) % (1 << 61)
    return total


def wait_for(room: Any, target: KVPoll, timeout_s: float = 10.0) -> KVPoll:
    """Poll a KVSender or KVReceiver until it reaches `target` (or Failed) or the timeout
    passes; returns the status it has then."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        st = room.poll()
        if st == KVPoll.Failed or st >= target:
            return st
        time.sleep(0.001)
    return room.poll()


def make_manager(role: str, spec: PoolSpec, config: TransferConfig
                 ) -> tuple[KVManager, PoolSet, list[ShmPoolBuffer]]:
    """A KVManager over the spec's pools (every rank's, with tensor parallelism)."""
    pools, shms = make_pools(spec)
    mgr = KVManager(role, shms[0] if shms else pools.tensors[0], config,  # type: ignore[arg-type]
                    spec.fingerprint(), pools=pools if spec.tp > 1 else None)
    return mgr, pools, shms


def _serve(conn: Connection, role: str, spec: PoolSpec, cfg: dict[str, Any]) -> None:
    mgr, pools, shms = make_manager(role, spec, TransferConfig(**cfg))
    rooms: dict[int, Any] = {}
    conn.send(("ok", mgr.bootstrap_addr if role == "prefill" else None))
    while True:
        op, args = conn.recv()
        try:
            if op == "close":
                mgr.close()
                out: Any = mgr.registered_regions()
                for shm in shms:
                    shm.close()
                conn.send(("ok", out))
                return
            out = _op(mgr, rooms, pools, op, args)
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _op(mgr: KVManager, rooms: dict[int, Any], pools: PoolSet, op: str,
        args: tuple[Any, ...]) -> Any:
    if op == "create_sender":
        rooms[args[0]] = mgr.create_sender(args[0])
    elif op == "create_receiver":
        rooms[args[0]] = mgr.create_receiver(args[0], args[1])
    elif op == "init":
        rooms[args[0]].init(args[1])
    elif op == "send":
        room, src, start, last, aux = args
        rooms[room].send(src, start, last, AuxData(*aux) if aux else None)
    elif op == "poll":
        r = rooms[args[0]]
        return int(r.poll()), r.failure_reason
    elif op == "wait":  # until status >= target or Failed, or timeout
        room, target, timeout = args
        return int(wait_for(rooms[room], KVPoll(target), timeout)), rooms[room].failure_reason
    elif op == "abort":
        rooms[args[0]].abort(args[1])
    elif op == "aux":
        a = rooms[args[0]].aux
        return None if a is None else (a.first_token_id, a.first_logprob, a.cached_tokens)
    elif op == "checksum":
        return kv_checksum(pools, args[0])
    elif op == "registered":
        return mgr.registered_regions()
    elif op == "paths":
        return mgr.transfer_paths()
    elif op == "cpu":  # this process's CPU time over the next args[0] seconds, in cores
        return _cpu_cores(args[0])
    else:
        raise ValueError(f"op: unknown {op!r}")
    return None


def _cpu_cores(seconds: float) -> float:
    def used() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0, c0 = time.monotonic(), used()
    time.sleep(seconds)
    return (used() - c0) / (time.monotonic() - t0)


class PeerProcess:
    """A child process holding one KVManager; `call()` is synchronous."""

    def __init__(self, role: str, spec: PoolSpec, config: TransferConfig,
                 start_timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, role, spec, asdict(config)),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise TimeoutError("peer process did not start")
        _, self.bootstrap_addr = self._conn.recv()

    def call(self, op: str, *args: Any, timeout_s: float = 60.0) -> Any:
        self._conn.send((op, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer op {op} timed out")
        status, out = self._conn.recv()
        if status != "ok":
            raise RuntimeError(out)
        return out

    def close(self) -> list[str]:
        """Close the child's manager (returns its regions still registered: should be [])."""
        try:
            out = self.call("close", timeout_s=30)
        finally:
            self.proc.join(timeout=10)
            self.kill()
        return out

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        self._conn.close()
