"""`ucx` backend over ucxx (tagged send/recv; UCX picks cuda_ipc/NVLink, RDMA, shm or TCP).

ucxx has no one-sided put/get in Python, and each message costs tens of microseconds, so a chunk
moves as ONE message: the sender gathers the chunk's pages into a staging buffer (or sends the
pool slice directly when the chunk is one run), the receiver receives into a staging buffer and
scatters it into the destination pages once the header is validated (kernels.page_copy). A
rejected chunk is received into staging and dropped: the pool is never written.
Threads: one asyncio loop thread per engine owns every ucxx object; write() blocks the caller's
transfer thread on a future.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import torch

from pdserve.kernels.page_copy import gather_pages, scatter_pages
from pdserve.kvtransfer.descriptors import DST, NUM, SRC, run_pages
from pdserve.kvtransfer.engine import ChunkHeader, ReceiveHandler, TransferEngine

log = logging.getLogger("pdserve.kvtransfer")


def _buf(t: torch.Tensor) -> Any:
    """What ucxx accepts: numpy for host memory, the tensor itself (cuda array) on GPU."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


class UcxEngine(TransferEngine):
    name = "ucx"

    def __init__(self, host: str = "127.0.0.1", send_timeout_s: float = 30.0, **_: Any) -> None:
        super().__init__()
        import ucxx  # imported here: a host without ucxx can still use the other backends

        self._ucxx = ucxx
        self._host = host
        self._timeout = send_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-ucx",
                                        daemon=True)
        self._thread.start()
        self._listener: Any = None
        self._eps: dict[str, Any] = {}  # sender: peer -> endpoint (loop thread only)
        self._recv_eps: list[Any] = []
        self._staging: torch.Tensor | None = None  # sender gather buffer (transfer thread)

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- receiving ------------------------------------------------------------------------
    def start_receiver(self, handler: ReceiveHandler) -> dict[str, Any]:
        if self._listener is None:
            async def _on_connect(ep: Any) -> None:
                await self._serve(ep, handler)

            async def _listen() -> Any:
                return self._ucxx.create_listener(_on_connect)

            self._listener = self._run(_listen(), 30)
        return {"host": self._host, "port": int(self._listener.port)}

    async def _serve(self, ep: Any, handler: ReceiveHandler) -> None:
        self._recv_eps.append(ep)
        pool = self.region("kv")
        page_bytes = pool[0].numel() * pool.element_size()
        max_bytes = pool.numel() * pool.element_size()
        try:
            while True:
                header = ChunkHeader.from_bytes(bytes(await ep.recv_obj()))
                nbytes = [n * page_bytes for n in header.descs[:, NUM].tolist()]
                total = sum(nbytes)
                if total > max_bytes:
                    raise ValueError(f"chunk of {total} bytes exceeds the pool")
                staging = torch.empty(total, dtype=torch.uint8, device=pool.device)
                if total:
                    await ep.recv(_buf(staging))
                stage = staging.view(pool.dtype).view(-1, *pool.shape[1:])

                def _write(views: list[torch.Tensor], stage: torch.Tensor = stage,
                           header: ChunkHeader = header) -> None:
                    del views  # the same pages, scattered in one pass
                    scatter_pages(stage, pool, run_pages(header.descs, DST))

                handler.place_chunk(f"ucx:{id(ep)}", header, nbytes, _write)
        except Exception as e:  # noqa: BLE001 - the peer went away or misbehaved
            log.debug("ucx receive endpoint closed: %s", e)

    # -- sending --------------------------------------------------------------------------
    async def _endpoint(self, peer: str, info: dict[str, Any]) -> Any:
        ep = self._eps.get(peer)
        if ep is None or ep.closed:
            ep = await self._ucxx.create_endpoint(info["host"], int(info["port"]))
            self._eps[peer] = ep
        return ep

    def write(self, peer: str, peer_info: dict[str, Any], header: ChunkHeader) -> None:
        pool = self.region("kv")
        if len(header.descs) == 1:
            s, _, n, _ = header.descs[0].tolist()
            payload = pool[s:s + n]
        else:
            pages = run_pages(header.descs, SRC)
            if self._staging is None or self._staging.shape[0] < len(pages):
                self._staging = torch.empty((len(pages), *pool.shape[1:]), dtype=pool.dtype,
                                            device=pool.device)
            payload = gather_pages(pool, pages, self._staging)

        async def _send() -> None:
            ep = await self._endpoint(peer, peer_info)
            await ep.send_obj(header.to_bytes())
            if payload.numel():
                await ep.send(_buf(payload))

        self._run(_send(), self._timeout)

    def drop_peer(self, peer: str) -> None:
        async def _drop() -> None:
            ep = self._eps.pop(peer, None)
            if ep is not None:
                await ep.close()

        try:
            self._run(_drop(), 5)
        except Exception as e:  # noqa: BLE001
            log.debug("ucx drop_peer: %s", e)

    def close(self) -> None:
        async def _close() -> None:
            for ep in [*self._eps.values(), *self._recv_eps]:
                try:
                    await ep.close()
                except Exception as e:  # noqa: BLE001
                    log.debug("ucx close: %s", e)
            self._eps.clear()
            self._recv_eps.clear()
            if self._listener is not None:
                self._listener.close()
                self._listener = None

        try:
            self._run(_close(), 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
            self._staging = None
            super().close()
