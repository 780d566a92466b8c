"""The OpenAPI document of the server, made to say what the server does.

FastAPI's generated schema promises a 422 for validation errors and JSON for every 200; this server
answers 400 (the OpenAI error object), streams `text/event-stream` when `stream` is true, serves
/metrics as Prometheus text and /health with an empty body. `install_openapi` rewrites each
operation's responses accordingly; the schemathesis run in tests/engine/test_server_schema.py
checks every response against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from firstlight.engine.server_guard import needs_key

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
_ERRORS = {
    "400": "invalid request: bad JSON, a wrong type or value, an unknown field, a prompt too long",
    "401": "missing or wrong API key (when the server runs with --api-key)",
    "408": "the request body did not arrive within --body-timeout-s",
    "413": "request body over --max-body-bytes",
    "500": "internal error (the message carries an id to find in the server log, never exception text)",
}
# one server-sent event (OpenAPI 3.1 has `schema` of text/event-stream describe each event): a `data:`
# line holding a JSON chunk, an error object, or the final `[DONE]`
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_CHOICES_BODY = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                 "properties": {"choices": {"type": "array"}, "usage": {"type": ["object", "null"]}}}
_SUCCESS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/completions", "post"): {
        "description": "the completion (JSON), or with `stream: true` server-sent events ending in `data: [DONE]`",
        "content": {"application/json": {"schema": _CHOICES_BODY},
                    "text/event-stream": {"schema": _SSE_EVENT}},
    },
    ("/v1/chat/completions", "post"): {
        "description": "the chat completion (JSON), or with `stream: true` server-sent events ending in "
                       "`data: [DONE]`",
        "content": {"application/json": {"schema": _CHOICES_BODY},
                    "text/event-stream": {"schema": _SSE_EVENT}},
    },
    ("/v1/models", "get"): {
        "description": "the served model",
        "content": {"application/json": {"schema": {"type": "object", "required": ["object", "data"],
                                                    "properties": {"data": {"type": "array"}}}}},
    },
    ("/health", "get"): {"description": "the engine is up (empty body)"},
    ("/metrics", "get"): {
        "description": "Prometheus text exposition format 0.0.4",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    },
    ("/reset_prefix_cache", "post"): {
        "description": "cached blocks dropped",
        "content": {"application/json": {"schema": {
            "type": "object", "required": ["num_dropped_blocks"],
            "properties": {"num_dropped_blocks": {"type": "integer", "minimum": 0}}}}},
    },
}
# which error statuses each route can answer (besides 500)
_ROUTE_ERRORS: dict[str, tuple[str, ...]] = {
    "/v1/completions": ("400", "401", "408", "413"),
    "/v1/chat/completions": ("400", "401", "408", "413"),
    "/v1/models": ("401",),
    "/reset_prefix_cache": ("400", "401", "408", "413", "415"),
    "/health": (),
    "/metrics": (),
}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="OpenAI-compatible completions and chat completions served by firstlight")
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses: dict[str, Any] = {"200": _SUCCESS.get((path, method), {"description": "OK"})}
            for status in (*_ROUTE_ERRORS.get(path, ("400",)), "500"):
                text = _ERRORS.get(status, "the request body must be JSON (Content-Type: application/json)")
                responses[status] = {"description": text, **_ERROR}
            op["responses"] = responses
            if path == "/reset_prefix_cache":
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "additionalProperties": False}}}}
            if needs_key(path):
                op["security"] = [{"bearer": []}, {}]
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                          "description": "the server's --api-key, when set"}}
    return schema


def install_openapi(app: FastAPI) -> None:
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "schema" not in cache:
            cache["schema"] = build_openapi(app)
        return cache["schema"]

    app.openapi = openapi  # type: ignore[method-assign]
