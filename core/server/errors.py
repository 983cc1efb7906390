"""API errors in the OpenAI error shape, and the handlers that turn any failure into one."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


# the error code (and header) of a failure that is the prefill server's, not this decode server's: a router counts
# it against the prefill server (or nobody), never against the decode server that reports it
UPSTREAM_PREFILL = "upstream_prefill"
FAILED_SERVER_HEADER = "X-Moeplex-Failed-Server"


class AsciiJSONResponse(JSONResponse):
    """JSON escaped to ASCII: an error may quote what the client sent, lone surrogates included."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


class ApiError(Exception):
    """A request the server refuses (4xx) or could not serve (5xx), with the reason to show the client."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.code == UPSTREAM_PREFILL:
            headers[FAILED_SERVER_HEADER] = "prefill"
        return AsciiJSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def on_http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    # starlette's own 404 / 405, in the same JSON shape as every other error
    return ApiError(exc.status_code, str(exc.detail)).response()


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # starlette re-raises after this response is sent, so uvicorn logs the traceback once
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()


EXCEPTION_HANDLERS = {ApiError: on_api_error, HTTPException: on_http_exception, Exception: on_unexpected}
