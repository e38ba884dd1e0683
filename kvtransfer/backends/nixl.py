"""`nixl` backend: the sender WRITEs pages one-sided into the receiver's registered pool
through NIXL (UCX underneath: RDMA, NVLink, shared memory or TCP, whichever it finds).

Decode registers its pool once (host memory or GPU memory: one region) and shares its agent's
metadata at handshake; prefill loads it and sets the connection up then (`connect`), so the
first room to a new peer does not pay for it. Per chunk the sender builds one descriptor per
run of pages consecutive on both sides (the page-major layout makes a run one byte range) and
posts one WRITE whose notification is the chunk header (room, descriptors, and on the last
chunk the aux data). NIXL delivers a notification only after its transfer's bytes landed, so
the receiver counts the chunk as soon as the header passes its checks (descriptors.py).

As with shm, the receiver cannot refuse bytes: the manager checks every destination against
the room's registration before write(), write() checks them against the peer's pool, and NIXL
refuses any byte outside the registered region. write() returns once the WRITE completed, so
nothing of a failed room is in flight after it (quiesce() covers a WRITE that could not be
cancelled after a timeout).
"""

from __future__ import annotations

import base64
import logging
import secrets
import time
from typing import Any

import numpy as np
import torch

from pdserve.kvtransfer.backends.nixl_lib import WARMUP, NotifPoller, new_agent
from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.descriptors import check_runs, coalesce
from pdserve.kvtransfer.engine import ReceiveHandler, TransferEngine, count_landed

log = logging.getLogger("pdserve.kvtransfer")


def pool_info(pool: torch.Tensor) -> dict[str, Any]:
    """Where a pool lives, as a peer needs it to address pages (JSON-able)."""
    return {"mem": "VRAM" if pool.is_cuda else "DRAM",
            "dev": (pool.device.index or 0) if pool.is_cuda else 0,
            "base": int(pool.data_ptr()), "num_pages": int(pool.shape[0]),
            "page_bytes": int(pool[0].numel() * pool.element_size())}


def run_descs(info: dict[str, Any], pages: np.ndarray, nums: np.ndarray) -> np.ndarray:
    """`[n, 3]` uint64 rows (address, bytes, device) for runs of `nums` pages from `pages`."""
    pb = int(info["page_bytes"])
    out = np.empty((len(pages), 3), dtype=np.uint64)
    out[:, 0] = int(info["base"]) + pages.astype(np.uint64) * pb
    out[:, 1] = nums.astype(np.uint64) * pb
    out[:, 2] = int(info["dev"])
    return out


class NixlEngine(TransferEngine):
    name = "nixl"
    one_sided = True

    def __init__(self, send_timeout_s: float = 30.0, **_: Any) -> None:
        super().__init__()
        self._timeout = send_timeout_s
        self._agent = new_agent(f"pdkv-{secrets.token_hex(8)}")
        self._reg: Any = None  # the registration of our pool
        self._local: dict[str, Any] = {}
        self._remotes: dict[str, str] = {}  # sender: peer -> remote agent name
        self._poller: NotifPoller | None = None
        self._handler: ReceiveHandler | None = None
        self._stuck: list[Any] = []  # WRITEs that timed out and could not be cancelled

    # -- memory ---------------------------------------------------------------------------
    def register(self, name: str, tensor: torch.Tensor) -> None:
        super().register(name, tensor)
        if name == "kv":  # the aux data travels in the notification: nothing else to register
            self._reg = self._agent.register_memory(tensor)
            self._local = pool_info(tensor)

    def deregister(self, name: str) -> None:
        if name == "kv" and self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
        super().deregister(name)

    # -- receiving ------------------------------------------------------------------------
    def start_receiver(self, handler: ReceiveHandler) -> dict[str, Any]:
        if self._reg is None:
            raise ValueError("pool_buffer: register the 'kv' region before start_receiver")
        self._handler = handler
        if self._poller is None:
            self._poller = NotifPoller(self._agent, self.deliver)
        md = base64.b64encode(self._agent.get_agent_metadata()).decode()
        return {"agent": self._agent.name, "md": md, **self._local}

    def deliver(self, header: bytes, token: bytes = b"") -> None:
        if header != WARMUP:  # the bytes are in place: only the checks remain
            count_landed(self._handler, "nixl", header)

    # -- sending --------------------------------------------------------------------------
    def connect(self, peer: str, peer_info: dict[str, Any]) -> None:
        if peer in self._remotes:
            return
        if int(peer_info["page_bytes"]) != self._local.get("page_bytes"):
            raise ValueError(f"page_bytes: peer {peer} has {peer_info['page_bytes']}, local "
                             f"{self._local.get('page_bytes')}")
        name = self._agent.add_remote_agent(base64.b64decode(peer_info["md"]))
        if isinstance(name, bytes):
            name = name.decode()
        if name != peer_info["agent"]:
            self._agent.remove_remote_agent(name)
            raise ValueError(f"nixl: peer {peer} announced agent {peer_info['agent']!r}, its "
                             f"metadata names {name!r}")
        self._remotes[peer] = name
        self._agent.make_connection(name)
        self._agent.send_notif(name, WARMUP)

    def write(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> None:
        if peer not in self._remotes:
            self.connect(peer, peer_info)
        remote = self._remotes[peer]
        runs = coalesce(header.descs)
        if len(runs) == 0:  # a last chunk with no pages left: only the header travels
            self._agent.send_notif(remote, header.to_bytes())
            return
        check_runs(runs, int(peer_info["num_pages"]), int(self._local["num_pages"]), peer)
        src, dst, num = runs[:, 0], runs[:, 1], runs[:, 2]
        agent = self._agent
        local = agent.get_xfer_descs(run_descs(self._local, src, num), self._local["mem"])
        far = agent.get_xfer_descs(run_descs(peer_info, dst, num), peer_info["mem"])
        handle = agent.initialize_xfer("WRITE", local, far, remote, header.to_bytes())
        done = False
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + self._timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nixl: WRITE to {peer} not done after {self._timeout}s")
                time.sleep(0)  # each check progresses the transfer; let other threads run
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"nixl: WRITE to {peer} failed ({state})")
            done = True
        finally:
            self._release(handle, done)

    def _release(self, handle: Any, done: bool) -> None:
        try:
            handle.release()
        except Exception as e:  # noqa: BLE001 - still running: quiesce() waits for it
            if done:
                raise
            log.warning("nixl: a timed-out WRITE could not be cancelled (%s)", e)
            self._stuck.append(handle)

    def notify(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> bool:
        return True  # the notification travelled with the WRITE

    def quiesce(self) -> None:
        deadline = time.monotonic() + self._timeout
        for handle in list(self._stuck):
            while (self._agent.check_xfer_state(handle) == "PROC"
                   and time.monotonic() < deadline):
                time.sleep(0.001)
            try:
                handle.release()
                self._stuck.remove(handle)
            except Exception as e:  # noqa: BLE001
                log.error("nixl: WRITE still not released after %ss: %s", self._timeout, e)

    def drop_peer(self, peer: str) -> None:
        name = self._remotes.pop(peer, None)
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001 - gone already
                log.debug("nixl: removing agent %s: %s", name, e)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None
        self.quiesce()
        for peer in list(self._remotes):
            self.drop_peer(peer)
        for name in list(self._regions):
            self.deregister(name)
        self._handler = None
        super().close()
        self._agent = None  # the last reference: NIXL tears the agent down with it
