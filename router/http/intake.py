"""What a client request passes before its handler answers it: the router it runs against,
the API key, the body read as JSON under the size limit (streamed, so an oversized body is
refused without being held in memory), and the model it names."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.errors import BodyTooLarge, InvalidRequest, NotFound, Unauthorized


def core_of(request: Request) -> RouterCore:
    """The RouterCore of the app serving `request` (set by `create_app`)."""
    return request.app.state.core


def check_auth(request: Request) -> None:
    """Unauthorized unless the router has no API key or the request carries it as a bearer
    token."""
    api_key = core_of(request).config.api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or token.strip() != api_key:
        raise Unauthorized("missing or wrong API key (Authorization: Bearer ...)",
                           code="invalid_api_key")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    """The body parsed as strict JSON (no NaN / Infinity); BodyTooLarge past `limit` bytes,
    InvalidRequest when it does not parse."""
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


def check_model(cfg: RouterConfig, model: str | None) -> None:
    """NotFound unless `model` is unset, the served name or the model's path."""
    if model is not None and model not in (cfg.model_name, cfg.model_path):
        raise NotFound(f"model: {model!r} does not exist; this router serves "
                       f"{cfg.model_name!r}", param="model", code="model_not_found")
