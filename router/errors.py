"""Errors the router reports to clients, with both their HTTP status and gRPC code."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """A request failed in a way the client is told about (never a stack trace).

    `param` names the offending request field, as in the OpenAI error shape.
    """

    status: int = 500
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    err_type: str = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def headers(self) -> dict[str, str]:
        """HTTP headers of the error answer."""
        return {}

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.code}}


class InvalidRequest(RouterError):
    status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    err_type = "invalid_request_error"

    @classmethod
    def from_value_error(cls, exc: ValueError, default_param: str | None = None,
                         code: str | None = None) -> InvalidRequest:
        """ValueErrors of our configs/params start with `field: ...`; keep that as `param`."""
        msg = str(exc)
        head, sep, _ = msg.partition(":")
        param = head if sep and head.isidentifier() else default_param
        return cls(msg, param=param, code=code)


class Unauthorized(RouterError):
    status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    err_type = "authentication_error"


class NotFound(RouterError):
    status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    err_type = "not_found_error"


class BodyTooLarge(RouterError):
    status = 413
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    err_type = "invalid_request_error"


class Overloaded(RouterError):
    """The queue in front of the workers is full (router/admission.py): refused at once."""

    status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    err_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int, code: str = "queue_full"):
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class NoWorkers(RouterError):
    status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    err_type = "service_unavailable"


class UpstreamFailed(RouterError):
    """The workers failed the request (after the retry, or after tokens were streamed)."""

    status = 502
    grpc_code = grpc.StatusCode.UNAVAILABLE
    err_type = "server_error"


class RequestTimeout(RouterError):
    status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    err_type = "timeout"
