"""One error shape for every failure: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.errors import InvalidRequestError
from conveyor.outputs import SHUTDOWN, CompletionOutput, RequestOutput
from conveyor.server.strict_body import InvalidTextError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "service_unavailable_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


UNREADABLE_BODY = "There was an error parsing the body"
"""FastAPI's message (a 400) for a body it could not decode at all, before any validation."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def sse_error(status: int, message: str, param: str | None = None, code: str | None = None) -> str:
    return f"data: {json.dumps(error_body(status, message, param, code))}\n\n"


def param_of(exc: InvalidRequestError) -> str | None:
    """The request field at fault, as the error names it (never parsed from its message)."""
    return exc.param


def _describe(err: dict[str, Any]) -> tuple[str, str | None]:
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query")]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON: " + str(err.get("msg", "")), None
    if err.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {param}", param
    if param is None and err.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return (
            "the request body must be a JSON object (got "
            + ("nothing" if err.get("type") == "missing" else "something else")
            + "); send JSON with the header Content-Type: application/json"
        ), None
    if err.get("type") == "missing":
        return f"missing required field: {param}", param
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    seen = err.get("input")
    shown = repr(seen) if seen is not None and len(repr(seen)) <= 80 else "(value not shown)"
    return f"{param}: {message} (got {shown})" if param else message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message, param = _describe(errors[0]) if errors else ("invalid request", None)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), param_of(exc))

    @app.exception_handler(InvalidTextError)
    async def _text(_: Request, exc: InvalidTextError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if message == UNREADABLE_BODY:  # FastAPI's words for a body json cannot decode at all
            message = "the request body could not be read as JSON (it is not UTF-8 text, or it nests too deeply)"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        """A bug, not the client's mistake: a JSON 500, and the connection closed after it (Connection: close), as
        the server closes it anyway once the error has gone through; a keep-alive client then opens a new one
        rather than send its next request into a closing connection."""
        logger.error("unhandled error", exc_info=exc)
        return error_response(
            500,
            "internal server error; the request was not completed (see the server log)",
            headers={"Connection": "close"},
        )


def as_api_error(out: RequestOutput) -> APIError:
    """A failed request's error for the API, with the engine's message and its error_code as `code`: 504 for a
    timeout, 503 with Retry-After for a request the server's shutdown ended (another server may take it), else 500
    ("non_finite_logits", "grammar", ...)."""
    if out.error_code == SHUTDOWN:
        return APIError(503, out.error or "the server shut down", code=SHUTDOWN, headers={"Retry-After": "5"})
    timed_out = out.error_code == "timeout"
    return APIError(504 if timed_out else 500, out.error or "the request failed", code=out.error_code or "engine_error")


def raise_if_ended_by_error(out: RequestOutput, c: CompletionOutput) -> None:
    """A stream whose choice just ended with finish_reason "error" (its final chunk sent) ends with the request's
    error event next, as a response body would be that error."""
    if c.finish_reason == "error" and out.error is not None:
        raise as_api_error(out)
