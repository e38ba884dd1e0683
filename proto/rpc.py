"""What the router and the workers share on the wire besides the generated messages.

Security (API keys, the cluster secret, TLS):
- Clients of the Router service send `authorization: Bearer KEY` (like vLLM's `--api-key`).
- The router sends the cluster (registration) secret to workers as `x-pdserve-secret` on every
  Worker RPC; workers started with a secret refuse calls without it (UNAUTHENTICATED).
- grpc.health.v1 and reflection stay open: probes and tooling need no key.
- TLS: servers given a certificate and key listen with TLS; clients given a CA file verify it.

Conversions: `SamplingParams`, token chunks and worker load to and from their protobuf forms.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2 as pb

# ---- security ---------------------------------------------------------------------------------

SECRET_KEY = "x-pdserve-secret"
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer_ok(metadata: dict[str, str], api_key: str) -> bool:
    scheme, _, token = metadata.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and _same(token.strip(), api_key)


def secret_ok(metadata: dict[str, str], secret: str) -> bool:
    return _same(metadata.get(SECRET_KEY, ""), secret)


def secret_metadata(secret: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying the cluster secret (None when there is none)."""
    return ((SECRET_KEY, secret),) if secret else None


Check = Callable[[str, dict[str, str]], "str | None"]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects a call with UNAUTHENTICATED when `check(method, metadata)` returns a message.

    Methods of OPEN_SERVICES are never checked.
    """

    def __init__(self, check: Check) -> None:
        self.check = check

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        method = details.method or ""
        if method.startswith(OPEN_SERVICES):
            return await continuation(details)
        metadata = {k: v for k, v in (details.invocation_metadata or ())
                    if isinstance(v, str)}
        problem = self.check(method, metadata)
        handler = await continuation(details)
        if problem is None or handler is None:
            return handler
        return _deny(handler, problem)


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover (makes this an async generator)

    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def api_key_check(api_key: str | None, methods: Sequence[str]) -> Check:
    """Check for the Router service: `methods` (full names) need the Bearer API key."""
    def check(method: str, metadata: dict[str, str]) -> str | None:
        if api_key is None or method not in methods or bearer_ok(metadata, api_key):
            return None
        return "missing or wrong API key (metadata authorization: Bearer ...)"
    return check


def secret_check(secret: str | None) -> Check:
    """Check for the Worker service: every RPC needs the cluster secret when one is set."""
    def check(method: str, metadata: dict[str, str]) -> str | None:
        if not secret or secret_ok(metadata, secret):
            return None
        return f"missing or wrong cluster secret ({SECRET_KEY} metadata)"
    return check


def _read(path: str, name: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{name}: cannot read {path!r}: {e.strerror}") from None


def add_port(server: grpc.aio.Server, addr: str, cert_file: str | None = None,
             key_file: str | None = None) -> int:
    """Bind `addr` (TLS when a certificate is given); returns the port, 0 when binding failed."""
    if cert_file and key_file:
        creds = grpc.ssl_server_credentials(
            [(_read(key_file, "tls_key_file"), _read(cert_file, "tls_cert_file"))])
        return server.add_secure_port(addr, creds)
    return server.add_insecure_port(addr)


def open_channel(addr: str, ca_file: str | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A client channel: TLS verified against `ca_file` when given, else plaintext."""
    if ca_file:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(ca_file, "tls_ca_file"))
        return grpc.aio.secure_channel(addr, creds, options=list(options))
    return grpc.aio.insecure_channel(addr, options=list(options))


def split_batch(items: list, max_bytes: int) -> tuple[list, list]:
    """The messages of `items` that fit one batch of `max_bytes` (at least one), and the rest."""
    size = 0
    for n, item in enumerate(items, 1):
        size += item.ByteSize()
        if size >= max_bytes:
            return items[:n], items[n:]
    return items, []


# ---- conversions ------------------------------------------------------------------------------

# Proto fields declared `optional` (their proto zero is not the default): copied only when set.
_OPTIONAL = ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "logprobs",
             "skip_special_tokens")
_PLAIN = ("min_tokens", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos")


def sampling_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    """Full wire form: every field is written, so the worker sees exactly these values."""
    msg = pb.SamplingParams(
        min_tokens=sp.min_tokens, top_k=sp.top_k, min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
        stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
        repetition_penalty=sp.repetition_penalty, skip_special_tokens=sp.skip_special_tokens,
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    return msg


def sampling_dict_from_proto(msg: pb.SamplingParams) -> dict[str, Any]:
    """Fields the sender set, as a dict (unset `optional` fields keep SamplingParams defaults).

    Floats are rounded to 6 significant digits: proto floats are 32-bit, and 0.9 must stay 0.9.
    """
    out: dict[str, Any] = {}
    for name in _OPTIONAL:
        if msg.HasField(name):
            out[name] = getattr(msg, name)
    for name in _PLAIN:
        out[name] = getattr(msg, name)
    if msg.stop:
        out["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        out["stop_token_ids"] = tuple(msg.stop_token_ids)
    if "top_k" in out and out["top_k"] == 0:
        out["top_k"] = -1
    for key, value in out.items():
        if isinstance(value, float):
            out[key] = float(f"{value:.6g}")
    return out


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field when a value is out of range."""
    return SamplingParams.from_dict(sampling_dict_from_proto(msg))


_LOAD_FIELDS = ("num_running", "num_waiting", "num_inflight", "kv_pages_total", "kv_pages_free",
                "kv_pages_cached", "kv_pages_in_use", "max_running")


def load_to_dict(load: pb.WorkerLoad) -> dict[str, int]:
    return {name: getattr(load, name) for name in _LOAD_FIELDS}


def load_from_dict(snapshot: dict[str, Any]) -> pb.WorkerLoad:
    """A scheduler's snapshot (missing fields are 0) as a WorkerLoad."""
    return pb.WorkerLoad(**{name: int(snapshot.get(name, 0)) for name in _LOAD_FIELDS})


def token_chunk(token_ids: Sequence[int], logprobs: Sequence[float] = (),
                top_logprobs: Sequence[tuple[Sequence[int], Sequence[float]]] = ()
                ) -> pb.TokenChunk:
    """The one place a TokenChunk is built: one logprob per token when logprobs were asked
    for, one (ids, logprobs) list of alternatives per token when top logprobs were."""
    chunk = pb.TokenChunk(token_ids=token_ids, logprobs=logprobs)
    for ids, lps in top_logprobs:
        chunk.top_logprobs.add(token_ids=ids, logprobs=lps)
    return chunk


def run_event_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio.run(main)`, on uvloop when it is installed. A router's one loop carries every
    token of every stream (a worker's, every message of its requests), and on uvloop its
    callbacks and socket writes cost less: the router's CPU time per streamed token fell ~10%
    (docs/performance.md, "Serving path")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if not hasattr(asyncio, "Runner"):  # Python 3.10
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
