"""Every error the gateway answers, in the OpenAI error shape
(`{"error": {"message", "type", "param", "code"}}`), never a stack trace:

- RouterError (validation, auth, not found, body too large, no workers, overload): its own
  status and headers (429 carries Retry-After);
- Starlette's HTTP errors: an unknown route is a 404 naming it, a wrong method a 405;
- anything else: 500 naming only the exception's type.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router.errors import RouterError


def error_body(message: str, err_type: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code), status_code=status)


async def router_error(request: Request, exc: RouterError) -> JSONResponse:
    return JSONResponse(exc.to_openai(), status_code=exc.status, headers=exc.headers())


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        return error_response(404, f"route {request.method} {request.url.path} not found",
                              "not_found_error", code="unknown_route")
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error")


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


def install(app: FastAPI) -> None:
    """Registers the three handlers on `app`."""
    app.add_exception_handler(RouterError, router_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
