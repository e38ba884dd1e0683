"""The OpenAI-compatible HTTP gateway (FastAPI), built per router by `create_app(core)`.

n > 1 and batched prompts fan out into one request flow per choice (seed + i per choice when a
seed is given, so choices differ but stay reproducible), at most MAX_N choices per request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router import openai_format as fmt
from pdserve.router.core import RouterCore
from pdserve.router.errors import BodyTooLarge, InvalidRequest, NotFound, RouterError, Unauthorized
from pdserve.router.fanout import FanOut
from pdserve.router.openai_schemas import ChatCompletionRequest, CompletionRequest, parse_body
from pdserve.router.prepare import PreparedRequest


def _error(status: int, message: str, err_type: str, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param,
                                   "code": code}}, status_code=status)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise BodyTooLarge(f"body: {length} bytes exceeds the limit of {limit} bytes",
                           code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body: exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"body: malformed JSON: {e}", code="invalid_json") from None


def create_app(core: RouterCore) -> FastAPI:
    app = FastAPI(title="pdserve router", openapi_url=None, docs_url=None, redoc_url=None)
    cfg = core.config

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
        return JSONResponse(exc.to_openai(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error(404, f"route {request.method} {request.url.path} not found",
                          "not_found_error", code="unknown_route")
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")

    def check_auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != cfg.api_key:
            raise Unauthorized("missing or wrong API key (Authorization: Bearer ...)",
                               code="invalid_api_key")

    def check_model(model: str | None) -> None:
        if model is not None and model not in (cfg.model_name, cfg.model_path):
            raise NotFound(f"model: {model!r} does not exist; this router serves "
                           f"{cfg.model_name!r}", param="model", code="model_not_found")

    async def run(request: Request, endpoint: str, chat: bool) -> Response:
        try:
            check_auth(request)
            body = await read_json(request, cfg.max_body_bytes)
            response = await (_chat(request, body) if chat else _completion(request, body))
            core.metrics.on_request(endpoint, response.status_code)
            return response
        except RouterError as e:
            core.metrics.on_request(endpoint, e.status)
            raise

    def _fan_out(req: Any, prompts: list[list[int]], sampling: dict, max_tokens: int | None,
                 rid: str, prompt_param: str
                 ) -> tuple[list[PreparedRequest], list[fmt.ChoiceState]]:
        prepared, choices = [], []
        for ids in prompts:
            for k in range(req.n):
                s = dict(sampling)
                if k and "seed" in s:
                    s["seed"] = s["seed"] + k
                idx = len(prepared)
                sub = rid if len(prompts) * req.n == 1 else f"{rid}-{idx}"
                prepared.append(core.preparer.build(ids, s, max_tokens, request_id=sub,
                                                    prompt_param=prompt_param))
                choices.append(fmt.ChoiceState(index=idx, counts_prompt=k == 0))
        return prepared, choices

    async def _completion(request: Request, body: Any) -> Response:
        req = parse_body(CompletionRequest, body)
        check_model(req.model)
        sampling = req.sampling(req.logprobs)
        prompts = [core.preparer.encode_text(p) if isinstance(p, str) else list(p)
                   for p in req.prompts()]
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        prepared, choices = _fan_out(req, prompts, sampling, req.max_tokens, rid, "prompt")
        return await _respond(request, req, prepared, choices, rid, chat=False,
                              want_lp=req.logprobs is not None)

    async def _chat(request: Request, body: Any) -> Response:
        req = parse_body(ChatCompletionRequest, body)
        check_model(req.model)
        sampling = req.sampling(req.logprobs_k())
        ids = core.preparer.encode_chat(req.messages)
        rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        prepared, choices = _fan_out(req, [ids], sampling, req.resolved_max_tokens(), rid,
                                     "messages")
        return await _respond(request, req, prepared, choices, rid, chat=True,
                              want_lp=req.logprobs)

    async def _respond(request: Request, req: Any, prepared: list[PreparedRequest],
                       choices: list[fmt.ChoiceState], rid: str, chat: bool,
                       want_lp: bool) -> Response:
        fan = FanOut([core.flow.run(p) for p in prepared])
        await fan.prime()
        created, model = int(time.time()), cfg.model_name
        if req.stream:
            gen = _sse(fan, choices, rid, created, model, chat, want_lp, req.include_usage)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(_collect(fan, choices))
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not collect.done():
                collect.cancel()
            await fan.close()
        error = collect.result()
        if error is not None:
            return _error(502, error, "server_error", code="worker_failed")
        build = fmt.chat_response if chat else fmt.completion_response
        return JSONResponse(build(rid, created, model, choices, want_lp))

    async def _collect(fan: FanOut, choices: list[fmt.ChoiceState]) -> str | None:
        async for index, event in fan.events():
            if event.error is not None:
                return event.error
            choices[index].add(event)
        return None

    async def _wait_disconnect(request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)

    async def _sse(fan: FanOut, choices: list[fmt.ChoiceState], rid: str, created: int,
                   model: str, chat: bool, want_lp: bool,
                   include_usage: bool) -> AsyncIterator[str]:
        def data(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if chat:
                for c in choices:
                    yield data(fmt.chat_chunk(rid, created, model, c.index,
                                              {"role": "assistant", "content": ""}, None, False))
            try:
                async for index, event in fan.events():
                    choice = choices[index]
                    choice.add(event)
                    if event.error is not None:
                        yield data({"error": {"message": event.error, "type": "server_error",
                                              "param": None, "code": "worker_failed"}})
                        continue
                    if not (event.text or event.finish_reason or (want_lp and event.logprobs)):
                        continue
                    if chat:
                        delta = {"content": event.text} if event.text else {}
                        yield data(fmt.chat_chunk(rid, created, model, index, delta, event,
                                                  want_lp))
                    else:
                        yield data(fmt.completion_chunk(rid, created, model, choice, event,
                                                        want_lp))
            except RouterError as e:
                yield data(e.to_openai())
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield data(fmt.usage_chunk(rid, created, model, obj, choices))
            yield "data: [DONE]\n\n"
        finally:
            await fan.close()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, "completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, "chat_completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        limit = core.preparer.context_limit()
        card = {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "root": cfg.model_path or cfg.model_name, "max_model_len": limit or None}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        reg = core.registry
        servable = bool(reg.available("prefill") and reg.available("decode")) or bool(
            reg.available("mixed"))
        if not servable:
            return _error(503, "no workers available", "service_unavailable", code="no_workers")
        return JSONResponse({"status": "ok", "workers": len(reg.available(
            "prefill", "decode", "mixed"))})

    @app.get("/workers")
    async def workers() -> Response:
        return JSONResponse({"workers": [w.to_json() for w in core.registry.all()]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(core.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
