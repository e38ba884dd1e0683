"""Worker registry: static workers from flags, self-registered workers with leases, health.

Invariant: only workers whose `state == "healthy"` are offered to the routing policies. A worker
leaves rotation when its health check or Worker.Status fails (a refused connection at once,
timeouts twice in a row), when a request RPC to it fails
with UNAVAILABLE (until the next health check passes), when its lease runs out (registered
workers are then forgotten), or while it drains.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.proto.rpc import load_to_dict, open_channel, secret_metadata
from pdserve.router.config import RouterConfig
from pdserve.router.session import SessionCall, WorkerSession

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")
SERVING_ROLES = ("decode", "mixed")  # the roles that run a request's decode
FAILURES_TO_EJECT = 3
HEALTH_TIMEOUTS_TO_EJECT = 2


@dataclass(eq=False)
class WorkerEntry:
    """The router's view of one worker. `inflight` counts requests this router has on it."""

    worker_id: str
    address: str
    role: str
    static: bool
    state: str = "unhealthy"
    bootstrap_addr: str = ""
    model: str = ""
    page_size: int = 0
    max_context_len: int = 0
    transfer_backend: str = ""
    transfer_backends: tuple[str, ...] = ()
    load: pb.WorkerLoad = field(default_factory=pb.WorkerLoad)
    lease_deadline: float | None = None
    draining: bool = False
    inflight: int = 0
    consecutive_failures: int = 0
    health_timeouts: int = 0  # health checks in a row that timed out
    channel: grpc.aio.Channel | None = None
    stub: pb_grpc.WorkerStub | None = None
    ca_file: str | None = None  # TLS to the worker, verified against this CA
    metadata: tuple[tuple[str, str], ...] | None = None  # sent on every call (cluster secret)
    serves_session: bool = False  # its Status says it serves Worker.Session
    use_session: bool = True  # the router's --worker-session (off: one RPC per call)
    session: WorkerSession | None = None

    @property
    def load_score(self) -> int:
        """Requests on the worker: the fresher of our own count and its last report."""
        reported = self.load.num_running + self.load.num_waiting
        return max(self.inflight, reported)

    @property
    def queued(self) -> int:
        """Requests on the worker past its running ceiling (0 when it reports none)."""
        ceiling = self.load.max_running
        return max(0, self.load_score - ceiling) if ceiling > 0 else 0

    def open(self) -> pb_grpc.WorkerStub:
        if self.stub is None:
            self.channel = open_channel(self.address, self.ca_file)
            self.stub = pb_grpc.WorkerStub(self.channel)
        return self.stub

    def _session(self) -> WorkerSession:
        if self.session is None or self.session.closed:
            self.session = WorkerSession(self.open(), self.metadata, self.address)
        return self.session

    def prefill_call(self, request: pb.PrefillRequest, timeout: float):
        """An awaitable of the PrefillResponse: on the worker's session when it serves one,
        else one Prefill RPC; either raises grpc.aio.AioRpcError with the worker's status."""
        if self.use_session and self.serves_session:
            return self._session().prefill(request, timeout)
        return self.open().Prefill(request, timeout=timeout, metadata=self.metadata)

    def decode_call(self, request: pb.DecodeRequest, timeout: float
                    ) -> SessionCall | grpc.aio.UnaryStreamCall:
        """A Decode call (read() / cancel()): on the session, or one Decode RPC."""
        if self.use_session and self.serves_session:
            return self._session().decode(request, timeout)
        return self.open().Decode(request, timeout=timeout, metadata=self.metadata)

    def drop_channel(self) -> grpc.aio.Channel | None:
        """Forget the channel (returned, for the caller to close) and retire the session: its
        open calls run to their end."""
        channel = self.channel
        self.channel = self.stub = None
        if self.session is not None:
            self.session.retire()
            self.session = None
        return channel

    def update_info(self, info: pb.WorkerInfo) -> None:
        self.serves_session = info.session
        if info.role in ROLES:
            self.role = info.role
        self.bootstrap_addr = info.bootstrap_addr
        self.model = info.model
        self.page_size = info.page_size
        self.max_context_len = info.max_context_len
        self.transfer_backend = info.transfer_backend
        self.transfer_backends = tuple(info.transfer_backends)
        if info.HasField("load"):
            self.load = info.load

    def to_proto(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            worker_id=self.worker_id, role=self.role, address=self.address,
            bootstrap_addr=self.bootstrap_addr, model=self.model, state=self.state,
            load=self.load, page_size=self.page_size, max_context_len=self.max_context_len,
            transfer_backend=self.transfer_backend,
            transfer_backends=list(self.transfer_backends))

    def to_json(self) -> dict:
        return {"worker_id": self.worker_id, "role": self.role, "address": self.address,
                "state": self.state, "bootstrap_addr": self.bootstrap_addr,
                "static": self.static, "max_context_len": self.max_context_len,
                "router_inflight": self.inflight, "queued": self.queued,
                "transfer_backend": self.transfer_backend,
                "transfer_backends": list(self.transfer_backends), **load_to_dict(self.load)}


class Registry:
    """Holds the workers; `start()` runs the health loop, `stop()` closes every channel."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._workers: dict[str, WorkerEntry] = {}
        self._task: asyncio.Task | None = None
        for role, addrs in (("prefill", config.prefill_addrs), ("decode", config.decode_addrs),
                            ("mixed", config.mixed_addrs)):
            for addr in addrs:
                wid = f"static-{role}-{addr}"
                self._workers[wid] = self._secured(WorkerEntry(worker_id=wid, address=addr,
                                                               role=role, static=True))

    def _secured(self, entry: WorkerEntry) -> WorkerEntry:
        entry.ca_file = self.config.tls_ca_file
        entry.metadata = secret_metadata(self.config.registration_secret)
        entry.use_session = self.config.worker_session
        return entry

    # ------------------------------------------------------------------ queries
    def all(self) -> list[WorkerEntry]:
        return sorted(self._workers.values(), key=lambda w: (w.role, w.address))

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)

    def available(self, *roles: str) -> list[WorkerEntry]:
        """Healthy, non-draining workers of the given roles, in a stable order."""
        return [w for w in self.all() if w.state == "healthy" and w.role in roles]

    def running_slots(self) -> int:
        """Requests the decode and mixed workers in rotation run at once, in all."""
        return sum(w.load.max_running for w in self.available(*SERVING_ROLES))

    def queued_requests(self) -> int:
        """Requests waiting past the decode and mixed workers' running ceilings, in all (every
        request passes exactly one of them; draining or unhealthy ones still hold theirs)."""
        return sum(w.queued for w in self._workers.values() if w.role in SERVING_ROLES)

    # ------------------------------------------------------------------ registration
    def check_secret(self, secret: str) -> bool:
        expected = self.config.registration_secret
        return expected is None or hmac.compare_digest(secret.encode(), expected.encode())

    def register(self, info: pb.WorkerInfo) -> WorkerEntry:
        """Add (or replace: same address = the worker restarted) a self-registered worker."""
        if info.role not in ROLES:
            raise ValueError(f"worker.role: must be one of {ROLES}, got {info.role!r}")
        host, sep, port = info.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"worker.address: must be HOST:PORT, got {info.address!r}")
        for old in [w for w in self._workers.values() if w.address == info.address]:
            self._remove(old)
        wid = info.worker_id or f"{info.role}-{secrets.token_hex(4)}"
        entry = self._secured(WorkerEntry(
            worker_id=wid, address=info.address, role=info.role, static=False,
            state="healthy", lease_deadline=self._clock() + self.config.lease_s))
        entry.update_info(info)
        self._workers[wid] = entry
        log.info("registered %s worker %s at %s", entry.role, wid, entry.address)
        return entry

    def heartbeat(self, worker_id: str, load: pb.WorkerLoad | None, draining: bool) -> bool:
        entry = self._workers.get(worker_id)
        if entry is None:
            return False
        if entry.lease_deadline is not None:
            entry.lease_deadline = self._clock() + self.config.lease_s
        if load is not None:
            entry.load = load
        entry.draining = draining
        if draining and entry.state == "healthy":
            entry.state = "draining"
        elif not draining and entry.state == "draining":
            entry.state = "healthy"
        return True

    def add_discovered(self, worker_id: str, role: str, address: str) -> WorkerEntry:
        """A worker found by discovery (Kubernetes): health-checked like a static one."""
        if role not in ROLES:
            raise ValueError(f"worker.role: must be one of {ROLES}, got {role!r}")
        entry = self._secured(WorkerEntry(worker_id=worker_id, address=address, role=role,
                                          static=True))
        self._workers[worker_id] = entry
        asyncio.get_running_loop().create_task(self._check(entry))  # in rotation once healthy
        return entry

    def remove_discovered(self, worker_id: str) -> None:
        entry = self._workers.get(worker_id)
        if entry is not None:
            self._remove(entry)

    def deregister(self, worker_id: str) -> bool:
        entry = self._workers.get(worker_id)
        if entry is None:
            return False
        self._remove(entry)
        return True

    def _remove(self, entry: WorkerEntry) -> None:
        self._workers.pop(entry.worker_id, None)
        if entry.channel is not None:
            channel = entry.drop_channel()
            # Calls still running on it finish (or fail) by themselves: a worker forgotten for a
            # late heartbeat under load keeps streaming its requests.
            grace = self.config.request_timeout_s if entry.inflight else 1.0
            asyncio.get_running_loop().create_task(channel.close(grace=grace))

    def report_failure(self, entry: WorkerEntry) -> None:
        """A request RPC failed on the worker; after FAILURES_TO_EJECT in a row it leaves
        rotation until its health check passes (a circuit breaker between health rounds)."""
        entry.consecutive_failures += 1
        if entry.consecutive_failures >= FAILURES_TO_EJECT and entry.state == "healthy":
            log.warning("worker %s (%s) failed %d requests in a row; out of rotation",
                        entry.worker_id, entry.address, entry.consecutive_failures)
            entry.state = "unhealthy"

    def report_success(self, entry: WorkerEntry) -> None:
        entry.consecutive_failures = 0

    # ------------------------------------------------------------------ health
    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        channels = [w.drop_channel() for w in self._workers.values() if w.channel is not None]
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                await self.check_all()
            except Exception:  # never let one bad round kill the loop
                log.exception("health check round failed")

    async def check_all(self) -> None:
        now = self._clock()
        for entry in list(self._workers.values()):
            if entry.lease_deadline is not None and now > entry.lease_deadline:
                log.warning("worker %s missed its lease; removed", entry.worker_id)
                self._remove(entry)
        entries = list(self._workers.values())
        await asyncio.gather(*(self._check(e) for e in entries))

    async def _check(self, entry: WorkerEntry) -> None:
        timeout = self.config.health_check_timeout_s
        try:
            stub = entry.open()
            health = health_pb2_grpc.HealthStub(entry.channel)
            try:
                resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
                serving = resp.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                serving = True  # no health service: Worker.Status alone decides
            status = await stub.Status(pb.StatusRequest(), timeout=timeout,
                                       metadata=entry.metadata)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            timed_out = not isinstance(e, grpc.aio.AioRpcError) or \
                e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            entry.health_timeouts = entry.health_timeouts + 1 if timed_out else 0
            if timed_out and entry.health_timeouts < HEALTH_TIMEOUTS_TO_EJECT:
                return  # one slow answer is load, not death: a refused connection ejects now
            if entry.state != "unhealthy":
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else repr(e)
                log.warning("worker %s (%s) failed its health check: %s", entry.worker_id,
                            entry.address, detail)
            entry.state = "unhealthy"
            return
        entry.health_timeouts = 0
        if entry.worker_id not in self._workers:
            return  # removed while we waited
        entry.update_info(status.info)
        if not serving:
            entry.state = "unhealthy"
            return
        entry.consecutive_failures = 0
        if entry.draining or status.info.state == "draining":
            entry.state = "draining"
        else:
            entry.state = "healthy"
