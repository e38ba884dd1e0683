"""The OpenAI-compatible HTTP gateway (FastAPI). A route's handler lives in the module of its
group:

    POST /v1/completions, /v1/chat/completions   completions.py (the SSE stream: sse.py)
    GET  /v1/models, /health, /workers, /metrics  status.py
    errors in the OpenAI shape (404, 405, 500)    errors.py
    API key, model name, body size and JSON       intake.py

`create_app(core)` builds one app per router. The app holds its RouterCore in `app.state.core`
(handlers read it with `intake.core_of`), so two routers in one process share nothing; the
route modules' APIRouters only list routes, which `include_router` copies into each app.
"""

from __future__ import annotations

from fastapi import FastAPI

from pdserve.router.core import RouterCore
from pdserve.router.http import completions, errors, status


def create_app(core: RouterCore) -> FastAPI:
    app = FastAPI(title="pdserve router", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.core = core
    errors.install(app)
    app.include_router(completions.routes)
    app.include_router(status.routes)
    return app
