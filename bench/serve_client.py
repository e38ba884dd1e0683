"""`pdserve bench` clients: one streamed request -> a RequestResult with every chunk's arrival.

HTTP: SSE with `stream_options.include_usage`; the final usage chunk carries the router's
`pdserve` extras (per-stage timings, workers). A chunk's text may hold several tokens: the
usage total is spread over the content chunks by `allocate_tokens`. gRPC: Router.Generate,
whose messages carry token ids (exact counts) and, on the last one, usage and timings.
Errors never raise: they end up in `RequestResult.error`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.http_stream import HttpStreamPool
from pdserve.bench.serve_config import BenchConfig
from pdserve.bench.serve_workload import BenchRequest


@dataclass
class RequestResult:
    input_len: int  # intended
    output_len: int  # max_tokens asked for
    start_s: float = 0.0  # send time, seconds since the run began
    chunk_times: list[float] = field(default_factory=list)  # arrival, seconds since send
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per content chunk
    end_s: float = 0.0  # last byte, seconds since send
    # The chunk with the finish reason (the last token's arrival, text or not; 0: none seen)
    finish_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: dict[str, float] | None = None  # the router's per-stage timings (ms)
    prefill_worker: str = ""
    decode_worker: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


def allocate_tokens(texts: list[str], total: int) -> list[int]:
    """Spread `total` tokens over chunks: one each, the rest in proportion to text length
    (largest remainder). Exact when every chunk is one token, the common case."""
    n = len(texts)
    if n == 0:
        return []
    if total <= n:
        return [1] * n
    extra = total - n
    weights = [max(1, len(t)) for t in texts]
    wsum = sum(weights)
    shares = [extra * w / wsum for w in weights]
    out = [1 + int(s) for s in shares]
    left = total - sum(out)
    order = sorted(range(n), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in order[:left]:
        out[i] += 1
    return out


def _finish_reason(obj: dict) -> str | None:
    choices = obj.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


def _chunk_text(obj: dict, chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if chat:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


class HttpBenchClient:
    """OpenAI-compatible streaming over keep-alive connections (http_stream.py; httpx for
    https URLs)."""

    def __init__(self, cfg: BenchConfig, model: str) -> None:
        self.cfg = cfg
        self.model = model
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.pool: HttpStreamPool | None = None
        self.http: httpx.AsyncClient | None = None
        if cfg.base_url.startswith("http://"):
            self.pool = HttpStreamPool(cfg.base_url, headers)
        else:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            self.http = httpx.AsyncClient(base_url=cfg.base_url, headers=headers,
                                          limits=limits,
                                          timeout=httpx.Timeout(cfg.request_timeout_s))

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.output_len,
                                "temperature": self.cfg.temperature, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.cfg.chat:
            body["messages"] = req.messages
        else:
            body["prompt"] = req.prompt
        return body

    async def send(self, req: BenchRequest, res: RequestResult) -> None:
        path = "/v1/chat/completions" if self.cfg.chat else "/v1/completions"
        texts: list[str] = []
        t0 = time.perf_counter()
        try:
            if self.pool is not None:
                await asyncio.wait_for(self._send_pooled(path, req, res, texts, t0),
                                       self.cfg.request_timeout_s)
            else:
                await self._send_httpx(path, req, res, texts, t0)
        except (httpx.HTTPError, OSError, ValueError, EOFError, asyncio.TimeoutError) as e:
            res.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            res.end_s = time.perf_counter() - t0
            res.chunk_tokens = allocate_tokens(texts, res.completion_tokens or len(texts))
            if res.error is None and not texts:
                res.error = "no output tokens"

    async def _send_pooled(self, path: str, req: BenchRequest, res: RequestResult,
                           texts: list[str], t0: float) -> None:
        assert self.pool is not None
        resp, conn = await self.pool.post(path, self.body(req))
        try:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            done = False
            async for line in resp.lines():  # to the end: the connection is then reused
                if not done:
                    done = self._line(line, res, texts, t0)
        finally:
            self.pool.release(resp, conn)

    async def _send_httpx(self, path: str, req: BenchRequest, res: RequestResult,
                          texts: list[str], t0: float) -> None:
        assert self.http is not None
        async with self.http.stream("POST", path, json=self.body(req)) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if self._line(line, res, texts, t0):
                    break

    def _line(self, line: str, res: RequestResult, texts: list[str], t0: float) -> bool:
        """One SSE line into the result; True at `[DONE]`."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        now = time.perf_counter() - t0
        obj = json.loads(data)
        if "error" in obj:
            res.error = str(obj["error"].get("message", obj["error"]))[:200]
            return False
        text = _chunk_text(obj, self.cfg.chat)
        finish = _finish_reason(obj)
        if finish:
            res.finish_s = now
        if text or (not texts and finish):
            # (a reply whose tokens decode to no text, e.g. one special token, ends with a
            # chunk that has only its finish reason: that is its output's arrival)
            texts.append(text)
            res.chunk_times.append(now)
        if obj.get("usage"):
            self._finish(obj, res)
        return False

    @staticmethod
    def _finish(obj: dict, res: RequestResult) -> None:
        usage = obj["usage"]
        res.prompt_tokens = int(usage.get("prompt_tokens", 0))
        res.completion_tokens = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens") or 0)
        extras = (obj.get("pdserve") or {}).get("choices") or []
        if extras:
            res.timings = extras[0].get("timings")
            res.prefill_worker = extras[0].get("prefill_worker") or ""
            res.decode_worker = extras[0].get("decode_worker") or ""

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.http is not None:
            await self.http.aclose()


class GrpcBenchClient:
    """Router.Generate (stream=True) on one shared grpc.aio channel."""

    def __init__(self, cfg: BenchConfig) -> None:
        import grpc

        from pdserve.proto import pdserve_pb2 as pb
        from pdserve.proto import pdserve_pb2_grpc as pb_grpc

        self.cfg, self.pb, self.grpc = cfg, pb, grpc
        self.channel = grpc.aio.insecure_channel(cfg.grpc_addr or "")
        self.stub = pb_grpc.RouterStub(self.channel)
        self.metadata = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else ()

    async def send(self, req: BenchRequest, res: RequestResult) -> None:
        pb = self.pb
        sampling = pb.SamplingParams(max_tokens=req.output_len, ignore_eos=True,
                                     temperature=self.cfg.temperature)
        if isinstance(req.prompt, list):
            msg = pb.GenerateRequest(input_ids=req.prompt, sampling=sampling, stream=True)
        else:
            msg = pb.GenerateRequest(text=req.prompt or "", sampling=sampling, stream=True)
        t0 = time.perf_counter()
        try:
            call = self.stub.Generate(msg, timeout=self.cfg.request_timeout_s,
                                      metadata=self.metadata or None)
            async for m in call:
                n = len(m.chunk.token_ids)
                if n:
                    res.chunk_times.append(time.perf_counter() - t0)
                    res.chunk_tokens.append(n)
                if m.HasField("usage"):
                    res.prompt_tokens = m.usage.prompt_tokens
                    res.completion_tokens = m.usage.completion_tokens
                    res.cached_tokens = m.usage.cached_tokens
                if m.HasField("timings"):
                    t = m.timings
                    res.timings = {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields}
                    res.prefill_worker, res.decode_worker = m.prefill_worker, m.decode_worker
        except self.grpc.aio.AioRpcError as e:
            res.error = f"gRPC {e.code().name}: {e.details()}"[:200]
        finally:
            res.end_s = time.perf_counter() - t0
            if res.error is None and not res.chunk_times:
                res.error = "no output tokens"

    async def close(self) -> None:
        await self.channel.close()
