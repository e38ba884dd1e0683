"""`POST /v1/completions` and `POST /v1/chat/completions`.

Both parse and validate the body (openai_schemas), tokenize, and fan out into one request
flow per choice: n > 1 and batched prompts give n x prompts flows (seed + i per choice when a
seed is given, so choices differ but stay reproducible; at most MAX_N choices per request).
Streamed, the answer is sse.py's event stream; otherwise the choices are collected into one
JSON body, and a client that disconnects first aborts every flow.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.router import openai_format as fmt
from pdserve.router.core import RouterCore
from pdserve.router.errors import RouterError
from pdserve.router.fanout import FanOut
from pdserve.router.http.errors import error_response
from pdserve.router.http.intake import check_auth, check_model, core_of, read_json
from pdserve.router.http.sse import EventStream, sse_stream
from pdserve.router.openai_schemas import ChatCompletionRequest, CompletionRequest, parse_body
from pdserve.router.prepare import PreparedRequest

routes = APIRouter()


@routes.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _run(request, "completions", chat=False)


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _run(request, "chat_completions", chat=True)


async def _run(request: Request, endpoint: str, chat: bool) -> Response:
    """Auth, body, the answer; the request counted in the metrics under its final status."""
    core = core_of(request)
    try:
        check_auth(request)
        body = await read_json(request, core.config.max_body_bytes)
        response = await (_chat(core, request, body) if chat
                          else _completion(core, request, body))
        core.metrics.on_request(endpoint, response.status_code)
        return response
    except RouterError as e:
        core.metrics.on_request(endpoint, e.status)
        raise


async def _completion(core: RouterCore, request: Request, body: Any) -> Response:
    req = parse_body(CompletionRequest, body)
    check_model(core.config, req.model)
    sampling = req.sampling(req.logprobs)
    prompts = [core.preparer.encode_text(p) if isinstance(p, str) else list(p)
               for p in req.prompts()]
    rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    prepared, choices = _fan_out(core, req, prompts, sampling, req.max_tokens, rid, "prompt")
    return await _respond(core, request, req, prepared, choices, rid, chat=False,
                          want_lp=req.logprobs is not None)


async def _chat(core: RouterCore, request: Request, body: Any) -> Response:
    req = parse_body(ChatCompletionRequest, body)
    check_model(core.config, req.model)
    sampling = req.sampling(req.logprobs_k())
    ids = core.preparer.encode_chat(req.messages)
    rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    prepared, choices = _fan_out(core, req, [ids], sampling, req.resolved_max_tokens(), rid,
                                 "messages")
    return await _respond(core, request, req, prepared, choices, rid, chat=True,
                          want_lp=req.logprobs)


def _fan_out(core: RouterCore, req: Any, prompts: list[list[int]], sampling: dict,
             max_tokens: int | None, rid: str, prompt_param: str
             ) -> tuple[list[PreparedRequest], list[fmt.ChoiceState]]:
    """One prepared request and one choice per (prompt, k < n); request ids `rid-<index>`
    unless there is only one."""
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


async def _respond(core: RouterCore, request: Request, req: Any,
                   prepared: list[PreparedRequest], choices: list[fmt.ChoiceState], rid: str,
                   chat: bool, want_lp: bool) -> Response:
    fan = FanOut([core.flow.run(p) for p in prepared])
    await fan.prime()  # errors before the first token still become an HTTP status
    created, model = int(time.time()), core.config.model_name
    if req.stream:
        gen = sse_stream(fan, choices, rid, created, model, chat, want_lp, req.include_usage)
        return EventStream(gen, fan.close)
    collect = asyncio.ensure_future(_collect(fan, choices))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()  # and let it unwind: a single flow runs inside that task
            await asyncio.gather(collect, return_exceptions=True)
        await fan.close()
    error = collect.result()
    if error is not None:
        return error_response(502, error, "server_error", code="worker_failed")
    build = fmt.chat_response if chat else fmt.completion_response
    return JSONResponse(build(rid, created, model, choices, want_lp))


async def _collect(fan: FanOut, choices: list[fmt.ChoiceState]) -> str | None:
    """Every event into its choice; the first worker error, or None."""
    async for index, event in fan.events():
        if event.error is not None:
            return event.error
        choices[index].add(event)
    return None


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)
