"""What the router serves and how it is doing:

- `GET /v1/models` (behind the API key): one card, the served name with the model's path as
  `root` and the context limit the workers report (None until one has);
- `GET /health`: 200 while a request can be served (a prefill and a decode worker, or a mixed
  one, available), else 503 `no_workers`;
- `GET /workers`: every registered worker's role, address, state, KV page counts and load;
- `GET /metrics`: the Prometheus text exposition.

Health, workers and metrics are open without the API key: probes and scrapers carry none.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.http.errors import error_response
from pdserve.router.http.intake import check_auth, core_of

routes = APIRouter()


@routes.get("/v1/models")
async def list_models(request: Request) -> Response:
    check_auth(request)
    core = core_of(request)
    cfg = core.config
    limit = core.preparer.context_limit()
    card = {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
            "root": cfg.model_path or cfg.model_name, "max_model_len": limit or None}
    return JSONResponse({"object": "list", "data": [card]})


@routes.get("/health")
async def health(request: Request) -> Response:
    reg = core_of(request).registry
    servable = bool(reg.available("prefill") and reg.available("decode")) or bool(
        reg.available("mixed"))
    if not servable:
        return error_response(503, "no workers available", "service_unavailable",
                              code="no_workers")
    return JSONResponse({"status": "ok", "workers": len(reg.available(
        "prefill", "decode", "mixed"))})


@routes.get("/workers")
async def workers(request: Request) -> Response:
    return JSONResponse({"workers": [w.to_json() for w in core_of(request).registry.all()]})


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(core_of(request).metrics.render(), media_type="text/plain; version=0.0.4")
