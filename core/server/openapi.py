"""The OpenAPI 3.1 document, derived from the same field declarations that validate requests."""

from __future__ import annotations

from typing import Sequence

from .endpoint import Endpoint
from .schema import json_schema

ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _post(endpoint: Endpoint, protected: bool) -> dict:
    operation = {
        "summary": endpoint.summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": json_schema(endpoint.fields)}}},
        "responses": {
            "200": {
                "description": "the answer as JSON, or server-sent events when stream is true",
                "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}},
            },
            "400": _error("malformed JSON, a wrong type, an unknown field, an out-of-range value, a prompt too long"),
            "413": _error("the body is over the server's size limit"),
            "500": _error("the engine failed while running the request"),
        },
    }
    if protected:
        operation["responses"]["401"] = _error("missing or wrong API key")
        operation["security"] = [{"bearer": []}]
    return operation


def _get(summary: str, protected: bool) -> dict:
    operation = {"summary": summary, "responses": {"200": {"description": summary}}}
    if protected:
        operation["responses"]["401"] = _error("missing or wrong API key")
        operation["security"] = [{"bearer": []}]
    return operation


def openapi_document(
    endpoints: Sequence[Endpoint], gets: dict[str, str], open_paths: Sequence[str], version: str, with_key: bool
) -> dict:
    """`gets` maps each GET path to its summary; paths in `open_paths` need no key even when one is set."""
    paths = {e.path: {"post": _post(e, with_key)} for e in endpoints}
    paths.update({path: {"get": _get(summary, with_key and path not in open_paths)} for path, summary in gets.items()})
    document = {
        "openapi": "3.1.0",
        "info": {"title": "moeplex", "version": version, "description": "OpenAI-compatible and SGLang-native serving"},
        "paths": paths,
        "components": {"schemas": {"Error": ERROR_SCHEMA}},
    }
    if with_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document
