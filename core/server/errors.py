"""Every failure the server answers, in OpenAI's shape: {"error": {"message", "type", "param", "code"}};
on the Messages API's routes (/v1/messages...) in Anthropic's: {"type": "error", "error": {"type", "message"}}.

Client mistakes are 4xx with a message that says what was wrong; only a fault inside the server
is a 500. The engine's own errors (core/errors.py) map to the status a client can act on.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from deepinfer.core.errors import EngineDeadError, InvalidRequestError, PromptTooLongError, QueueFullError

logger = logging.getLogger("deepinfer.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


# Anthropic's error types (https://docs.anthropic.com/en/api/errors); 503 is its "overloaded_error".
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


def speaks_anthropic(path: str | None) -> bool:
    """Whether the route at `path` answers errors in Anthropic's shape."""
    return path is not None and (path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"))


class APIError(Exception):
    """An answer other than 200; raised anywhere in a handler, rendered by the app's handler."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class InvalidParameter(APIError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(400, message, param=param, code="invalid_parameter")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               path: str | None = None) -> dict:
    """The error's body for the route at `path` (OpenAI's shape unless it is a Messages API route)."""
    if speaks_anthropic(path):
        return anthropic_error_body(status, message)
    return {"error": {"message": message, "type": _TYPE_BY_STATUS.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPE_BY_STATUS.get(status, "invalid_request_error"),
                                       "message": message}}


def error_bytes(status: int, message: str, param: str | None = None, code: str | None = None,
                path: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, param, code, path)).encode()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, path: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, path), status_code=status, headers=headers)


def engine_error_to_api(err: Exception) -> APIError:
    """The status an engine error means to the client (a PromptTooLongError is its fault, a full queue is not)."""
    if isinstance(err, QueueFullError):
        return APIError(429, str(err), code="queue_full")
    if isinstance(err, PromptTooLongError):
        return APIError(400, str(err), code="context_length_exceeded")
    if isinstance(err, InvalidRequestError):
        return APIError(400, str(err), code="invalid_parameter")
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), code="engine_dead")
    return APIError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's error list as one line: 'messages.0.role: Field required; ...', and the first param."""
    parts, first_param = [], None
    for item in errors:
        location = [str(p) for p in item.get("loc", ()) if p != "body"]
        # Union members add their type name to the location ("str", "list[int]"); drop those.
        location = [p for p in location if not any(c in p for c in "[]") and p not in ("str", "int", "float")]
        where = ".".join(location)
        first_param = first_param or where or None
        message = item.get("msg", "invalid value")
        if not where and item.get("type") in ("missing", "model_attributes_type", "model_type", "dict_type"):
            return "the request body must be a JSON object", None
        if item.get("type") == "json_invalid":
            return "request body is not valid JSON: " + str(item.get("ctx", {}).get("error", message)), None
        parts.append(f"{where}: {message}" if where else message)
    unique = list(dict.fromkeys(parts))
    return "; ".join(unique[:5]) or "invalid request body", first_param


class ClientGone(Exception):
    """The client hung up before its request body arrived; nothing can be answered."""


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": counted, never sent

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if err.status == 429 else None
        return error_response(err.status, err.message, err.param, err.code, headers=headers, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI clients expect 400 for a malformed body.
        message, param = validation_message(err.errors())
        return error_response(400, message, param=param, code="invalid_parameter", path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
                415: "unsupported_media_type"}.get(err.status_code)
        return error_response(err.status_code, str(err.detail), code=code, headers=getattr(err, "headers", None),
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(500, f"internal error: {type(err).__name__}", code="internal_error",
                              path=request.url.path)
