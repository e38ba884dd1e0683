"""A deterministic Worker gRPC double for router tests (no tests here; imported by others).

It emits a fixed token sequence (cycled) up to max_tokens (prefill answers with the first one,
as the real prefill worker does), records every call and every Abort,
and fails on demand: the next N Prefill/Decode calls, a Decode after K tokens, or its health.
As a real decode worker, a Decode with a bootstrap room sends no token before its room's
prefill succeeded (the KV comes from there): a failed prefill is never outrun by decode tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.server import RouterServer
from pdserve.worker.session import serve_session

PREFILL_WAIT_S = 10.0
_prefilled: dict[int, asyncio.Event] = {}  # room -> set once its prefill answered
# request id -> its prompt: a continuation (that prompt plus the tokens streamed so far) goes on
# in the token sequence where the request was, as a model would.
_prompts: dict[str, list[int]] = {}


def _room(room: int) -> asyncio.Event:
    return _prefilled.setdefault(room, asyncio.Event())


@dataclass
class FakeWorker(pb_grpc.WorkerServicer):
    role: str = "prefill"
    tokens: list[int] = field(default_factory=lambda: [5, 6, 7])
    eos_id: int | None = None
    max_context_len: int = 4096
    token_delay_s: float = 0.0
    cached_tokens: int = 3
    fail_prefill: int = 0  # the next N Prefill calls fail with UNAVAILABLE
    fail_decode: int = 0  # the next N Decode calls fail before any token (with fail_code)
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    fail_decode_after: int | None = None  # Decode fails after this many tokens
    load: pb.WorkerLoad = field(default_factory=lambda: pb.WorkerLoad(kv_pages_total=100,
                                                                      kv_pages_free=90))
    prefill_requests: list[pb.PrefillRequest] = field(default_factory=list)
    decode_requests: list[pb.DecodeRequest] = field(default_factory=list)
    aborts: list[pb.AbortRequest] = field(default_factory=list)
    decode_cancelled: int = 0
    session: bool = True  # serves Worker.Session as the real workers do (worker/session.py)
    port: int = 0
    _server: grpc.aio.Server | None = None
    _health: health.aio.HealthServicer | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeWorker:
        self._server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(self, self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        await self.set_serving(True)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._health.set("", status)

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(role=self.role, address=self.address,
                             bootstrap_addr=f"127.0.0.1:{self.port + 1}" if self.role == "prefill"
                             else "", model="tiny", load=self.load, page_size=16,
                             max_context_len=self.max_context_len, transfer_backend="fake",
                             session=self.session)

    async def Status(self, request, context):
        return pb.StatusResponse(info=self.info())

    async def Session(self, request_iterator, context):
        if not self.session:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no sessions")
        async for batch in serve_session(self, request_iterator):
            yield batch

    async def Prefill(self, request, context):
        self.prefill_requests.append(request)
        if self.fail_prefill > 0:
            self.fail_prefill -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected prefill failure")
        _room(request.room).set()
        # As the real prefill worker: the first token (what decode then streams first) in the
        # answer, and the finish reason when that token already ends the request.
        first, finish = self._token(request, 0)
        return pb.PrefillResponse(
            request_id=request.request_id, cached_tokens=self.cached_tokens,
            timings=pb.StageTimings(queue_ms=1.0, bootstrap_ms=2.0, prefill_ms=3.0),
            first_token=first, finish_reason=finish)

    def _token(self, request, i: int) -> tuple[pb.TokenChunk, str]:  # noqa: ANN001
        """Output token i of `request` as a chunk, and the finish reason it brings ("" none)."""
        sp = request.sampling
        max_tokens = sp.max_tokens if sp.HasField("max_tokens") else 16
        ids = list(request.input_ids)
        prompt = _prompts.get(request.request_id)
        if prompt is None or ids[:len(prompt)] != prompt:
            prompt = _prompts[request.request_id] = ids
        tid = self.tokens[(len(ids) - len(prompt) + i) % len(self.tokens)]
        chunk = pb.TokenChunk(token_ids=[tid])
        if sp.HasField("logprobs"):
            chunk.logprobs.append(-0.5)
            if sp.logprobs > 0:
                alts = [tid] + [t for t in self.tokens if t != tid][: sp.logprobs - 1]
                chunk.top_logprobs.add(token_ids=alts, logprobs=[-0.5] * len(alts))
        stop = self.eos_id is not None and tid == self.eos_id and not sp.ignore_eos
        return chunk, "stop" if stop else "length" if i == max_tokens - 1 else ""

    async def Decode(self, request, context):
        self.decode_requests.append(request)
        if self.fail_decode > 0:
            self.fail_decode -= 1
            await context.abort(self.fail_code, "injected decode failure")
        if request.bootstrap_addr:  # its KV comes from a prefill worker
            try:
                await asyncio.wait_for(_room(request.room).wait(), PREFILL_WAIT_S)
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no KV for the room")
            finally:
                _prefilled.pop(request.room, None)
        sp = request.sampling
        max_tokens = sp.max_tokens if sp.HasField("max_tokens") else 16
        try:
            for i in range(max_tokens):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if self.fail_decode_after is not None and i == self.fail_decode_after:
                    await context.abort(grpc.StatusCode.INTERNAL, "injected mid-stream failure")
                chunk, finish = self._token(request, i)
                msg = pb.DecodeResponse(request_id=request.request_id, chunk=chunk)
                if finish:
                    msg.finish_reason = finish
                    msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(request.input_ids),
                                                completion_tokens=i + 1))
                    msg.timings.CopyFrom(pb.StageTimings(transfer_ms=4.0, decode_ms=5.0,
                                                         ttft_ms=6.0))
                yield msg
                if finish:
                    return
        except asyncio.CancelledError:
            self.decode_cancelled += 1
            raise

    async def Abort(self, request, context):
        self.aborts.append(request)
        return pb.AbortResponse(found=True)


async def wait_for(pred, timeout: float = 3.0, step: float = 0.02) -> bool:
    """Poll `pred()` until true or the timeout passes."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if pred():
            return True
        await asyncio.sleep(step)
    return bool(pred())


WORDS = " The capital of France is Paris. hello world"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    from pdserve.engine.loader import load_tokenizer as _load_tokenizer

    return _load_tokenizer(tiny_model_dir)


@pytest.fixture
async def cluster(tokenizer):
    """Factory: cluster(num_prefill=1, num_decode=1, num_mixed=0, **config) -> (router, fakes)."""
    started: list = []

    async def make(num_prefill: int = 1, num_decode: int = 1, num_mixed: int = 0,
                   worker_kw: dict | None = None, **cfg):
        ids = tokenizer.encode(WORDS, add_special_tokens=False)
        fakes = {"prefill": [], "decode": [], "mixed": []}
        for role, num in (("prefill", num_prefill), ("decode", num_decode), ("mixed", num_mixed)):
            for _ in range(num):
                kw = {"tokens": list(ids), "eos_id": 2, **(worker_kw or {})}
                fake = await FakeWorker(role=role, **kw).start()
                started.append(fake)
                fakes[role].append(fake)
        cfg.setdefault("health_check_interval_s", 0.2)
        cfg.setdefault("health_check_timeout_s", 0.5)
        config = RouterConfig(
            prefill_addrs=tuple(f.address for f in fakes["prefill"]),
            decode_addrs=tuple(f.address for f in fakes["decode"]),
            mixed_addrs=tuple(f.address for f in fakes["mixed"]),
            served_model_name="tiny", **cfg)
        router = RouterServer(config, tokenizer=tokenizer)
        await router.start()
        started.append(router)
        # A first health check that times out on a loaded machine leaves a worker out of
        # rotation until the next round: start the test once every fake is in it.
        total = sum(len(v) for v in fakes.values())
        await wait_for(lambda: len(router.core.registry.available(*fakes)) == total,
                       timeout=10.0)
        return router, fakes

    yield make
    for obj in reversed(started):
        await obj.stop()


