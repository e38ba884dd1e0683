"""Registration with a router: register, heartbeat the load, re-register, deregister.

Registration is optional (`--router`): the worker registers, heartbeats its load every interval,
re-registers when the router forgot it (router restart), and deregisters when it drains.

Reconnection is bounded whatever the outage: gRPC's own reconnect backoff grows to minutes on a
channel that keeps failing, so while the router is unreachable every attempt (every RETRY_S)
goes out on a fresh channel, and the channel's backoff is capped at a second besides. A new
router is found within RETRY_S plus a connect of its being ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.proto.rpc import open_channel

log = logging.getLogger(__name__)

RETRY_S = 0.25  # between registration attempts while the router is unreachable
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250),
                   ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 1000))


class RouterLink:
    """Registration + heartbeat lease with a router's Router service."""

    def __init__(self, router_addr: str, info_fn: Callable[[], pb.WorkerInfo],
                 load_fn: Callable[[], pb.WorkerLoad], secret: str = "",
                 ca_file: str | None = None) -> None:
        self.router_addr = router_addr
        self.info_fn = info_fn
        self.load_fn = load_fn
        self.secret = secret
        self.ca_file = ca_file
        self.worker_id = ""
        self.interval_s = 1.0
        self.draining = False
        self._channel = open_channel(router_addr, ca_file, CHANNEL_OPTIONS)
        self._stub = pb_grpc.RouterStub(self._channel)
        self._task: asyncio.Task | None = None

    async def _reopen(self) -> None:
        """A fresh channel: its first connection attempt goes out at once, not after the
        failed channel's backoff."""
        old, self._channel = self._channel, open_channel(self.router_addr, self.ca_file,
                                                         CHANNEL_OPTIONS)
        self._stub = pb_grpc.RouterStub(self._channel)
        await old.close()

    async def _register(self) -> None:
        resp = await self._stub.RegisterWorker(
            pb.RegisterWorkerRequest(worker=self.info_fn(), secret=self.secret), timeout=5)
        self.worker_id = resp.worker_id
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        log.info("registered with router %s as %s", self.router_addr, self.worker_id)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            delay = self.interval_s
            try:
                if not self.worker_id:
                    await self._register()
                else:
                    resp = await self._stub.Heartbeat(pb.HeartbeatRequest(
                        worker_id=self.worker_id, load=self.load_fn(), secret=self.secret,
                        draining=self.draining), timeout=5)
                    if not resp.known:
                        self.worker_id = ""
                        continue
            except grpc.aio.AioRpcError as e:  # router down or restarting: keep trying
                log.debug("router %s unreachable: %s", self.router_addr, e.code())
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.worker_id = ""
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    await self._reopen()
                    delay = min(self.interval_s, RETRY_S)
            await asyncio.sleep(delay)

    async def deregister(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.worker_id:
            try:
                await self._stub.Deregister(pb.DeregisterRequest(
                    worker_id=self.worker_id, secret=self.secret), timeout=3)
            except grpc.aio.AioRpcError:
                pass
        await self._channel.close()
