"""The OpenAPI schema (/openapi.json), written to match what the server does.

The handlers read raw requests (parsing happens off the event loop), so FastAPI cannot see their
bodies; the request schemas are added here from the same pydantic models that validate them. Each
route lists the statuses it answers, errors in OpenAI's shape (Anthropic's on /v1/messages), and its
real content types: a completion, message or response is JSON or, with `stream: true`,
`text/event-stream`; /metrics is Prometheus text.
FastAPI's 422 (a status this server never sends) is removed. Integer fields are JSON Schema
integers, which include integral floats such as 46.0, as the server accepts them.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from deepinfer.core.server.anthropic_protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    MessagesRequest,
)
from deepinfer.core.server.metrics import CONTENT_TYPE
from deepinfer.core.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from deepinfer.core.server.responses_protocol import ResponsesRequest

_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "Invalid request: malformed JSON, a wrong field, a prompt too long or a field this server lacks",
    401: "Missing or invalid API key (only when the server has --api-key)",
    404: "Unknown model",
    413: "Request body larger than --max-body-bytes",
    415: "Content-Type is not application/json",
    429: "The waiting queue is full, or too many requests are being prepared; retry later",
    503: "The model is loading or failed to load, or the server is shutting down",
}
_POST_ERRORS = (400, 401, 404, 413, 415, 429, 503)


def _ref(model) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _errors(statuses, shape=ErrorResponse) -> dict:
    return {str(status): {"description": _ERRORS[status], "content": {"application/json": {"schema": _ref(
        shape)}}} for status in statuses}


def _json_body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _completion_answer(what: str) -> dict:
    return {"description": f"The {what} (JSON), or with stream: true its chunks as server-sent events ending "
                           f"with 'data: [DONE]'",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}}}}


def _events_answer(what: str, events: str) -> dict:
    return {"description": f"The {what} (JSON), or with stream: true {events} as server-sent events",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}}}}


def _json_answer(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


def build_openapi(app: FastAPI) -> dict:
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    models = [ChatCompletionRequest, CompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
              DetokenizeRequest, ErrorResponse, MessagesRequest, CountTokensRequest, AnthropicErrorResponse,
              ResponsesRequest]
    _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components.update(definitions["$defs"])
    paths = schema["paths"]
    operations = {
        ("/v1/chat/completions", "post"): (_json_body(_ref(ChatCompletionRequest)),
                                           {"200": _completion_answer("chat completion"), **_errors(_POST_ERRORS)}),
        ("/v1/completions", "post"): (_json_body(_ref(CompletionRequest)),
                                      {"200": _completion_answer("completion"), **_errors(_POST_ERRORS)}),
        ("/v1/messages", "post"): (_json_body(_ref(MessagesRequest)), {
            "200": _events_answer("Anthropic message", "Anthropic's named events (message_start ... message_stop)"),
            **_errors(_POST_ERRORS, AnthropicErrorResponse)}),
        ("/v1/messages/count_tokens", "post"): (_json_body(_ref(CountTokensRequest)), {
            "200": _json_answer("{input_tokens}"), **_errors(_POST_ERRORS, AnthropicErrorResponse)}),
        ("/v1/responses", "post"): (_json_body(_ref(ResponsesRequest)), {
            "200": _events_answer("response", "the Responses API's named events (response.created ... "
                                              "response.completed)"), **_errors(_POST_ERRORS)}),
        ("/tokenize", "post"): (_json_body({"oneOf": [_ref(TokenizeCompletionRequest), _ref(TokenizeChatRequest)]}),
                                {"200": _json_answer("{count, max_model_len, tokens, token_strs}"),
                                 **_errors(_POST_ERRORS)}),
        ("/detokenize", "post"): (_json_body(_ref(DetokenizeRequest)),
                                  {"200": _json_answer("{prompt}"), **_errors(_POST_ERRORS)}),
        ("/v1/models", "get"): (None, {"200": _json_answer("The served model"), **_errors((401, 503))}),
        ("/v1/models/{model}", "get"): (None, {"200": _json_answer("The model's card"),
                                               **_errors((401, 404, 503))}),
        ("/health", "get"): (None, {"200": _json_answer("Ready: the engine's state"),
                                    "503": _json_answer("Loading, failed to load, or shutting down")}),
        ("/metrics", "get"): (None, {"200": {"description": "Prometheus text exposition",
                                             "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}}),
    }
    for (path, method), (request_body, responses) in operations.items():
        operation = paths[path][method]
        if request_body is not None:
            operation["requestBody"] = request_body
        operation["responses"] = responses
    return schema


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi
