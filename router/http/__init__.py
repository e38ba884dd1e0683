"""The OpenAI-compatible HTTP gateway (FastAPI). A route's handler lives in the module of its
group:

    POST /v1/completions, /v1/chat/completions   completions.py (the SSE stream: sse.py)
    GET  /v1/models, /health, /workers, /metrics  status.py
    errors in the OpenAI shape (404, 405, 500)    errors.py
    API key, model name, body size and JSON       intake.py

`create_app(core)` builds one app per router. The app holds its RouterCore in `app.state.core`
(handlers read it with `intake.core_of`), so two routers in one process share nothing; the
route modules' APIRouters only list routes, which `include_router` copies into each app.

The two generation routes skip FastAPI's middleware, routing and dependency layers (`Direct`):
per request those cost the router's one loop ~14% of its CPU (docs/performance.md, "Serving
path"), and at a wave of 256 new requests the loop is what they wait for. Their handlers,
errors and responses are the same either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response

from pdserve.router.core import RouterCore
from pdserve.router.errors import RouterError
from pdserve.router.http import completions, errors, status

log = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]


class Direct:
    """An ASGI app: `POST` to a generation route straight to its handler (RouterError and any
    other exception answered by the handlers errors.py installs on the app), everything else
    to the FastAPI app."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.state = app.state
        self.routes: dict[str, Handler] = {"/v1/completions": completions.completions,
                                           "/v1/chat/completions": completions.chat_completions}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        handler = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if handler is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app  # what Request.app (intake.core_of) reads
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except RouterError as e:
            response = await errors.router_error(request, e)
        except Exception as e:  # noqa: BLE001 - a 500 naming the type, as the app answers
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            response = await errors.internal_error(request, e)
        await response(scope, receive, send)


def create_app(core: RouterCore) -> Direct:
    app = FastAPI(title="pdserve router", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.core = core
    errors.install(app)
    app.include_router(completions.routes)
    app.include_router(status.routes)
    return Direct(app)
