"""``GET /openapi.json``: an OpenAPI 3.1 description of KVStream's routes, built from the same
pydantic models that validate the bodies, so the two cannot drift apart.

The request schemas are what KVStream validates in front of a backend that translates
(Ollama's native API, the in-process engine). In front of a runtime that speaks OpenAI
itself, the body is forwarded and the runtime judges it; every other route is passed
through to the runtime and is the runtime's to describe."""

from __future__ import annotations

from typing import Any

from kvstream import __version__
from kvstream.api.schemas import ChatCompletionRequest, CompletionRequest, WarmRequest

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


# /v1/embeddings as the in-process engine reads it (routes_embeddings.py); in front of a
# runtime the body is forwarded and the runtime judges it.
EMBEDDINGS_REQUEST = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "input": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            {"type": "array", "minItems": 1, "maxItems": 2048,
             "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}},
        ]},
        "encoding_format": {"enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "description": "Only the model's own width"},
    },
    "required": ["input"],
}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "OpenAI-shaped error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}} for c in codes}


def _json(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


def _generation(schema: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
            "responses": {
                "200": {
                    "description": "The completion (JSON), or its stream (text/event-stream) when stream is true",
                    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}},
                },
                **_errors(400, 401, 404, 413, 429, 502, 503, 504),
            },
        }
    }


# The Responses API body as KVStream reads it where it answers the route itself (the
# in-process engine, Ollama: responses_format.py); elsewhere the runtime judges it.
RESPONSES_REQUEST = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "object"}}]},
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 0},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "stream": {"type": "boolean"},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "function"}, "name": {"type": "string"}, "description": {"type": "string"},
            "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}},
        "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {"type": "object", "required": ["type", "name"]}]},
        "parallel_tool_calls": {"type": "boolean"},
        "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]}}}}},
        "reasoning": {"type": ["object", "null"]},
        "store": {"type": "boolean", "description": "Keep the response (default true) for previous_response_id and retrieval"},
        "previous_response_id": {"type": ["string", "null"], "description": "A stored response this one continues"},
        "background": {"type": "boolean", "description": "Run on without the request (needs store): polled, streamed "
                       "again, cancelled"},
    },
    "required": ["input"],
}


RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
CONVERSATION_ID = {"name": "conversation_id", "in": "path", "required": True, "schema": {"type": "string"}}
PAGE = [{"name": name, "in": "query", "required": False, "schema": schema} for name, schema in (
    ("limit", {"type": "integer", "minimum": 1, "maximum": 100}), ("order", {"enum": ["asc", "desc"]}),
    ("after", {"type": "string"}))]
STREAM_AGAIN = [{"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
                {"name": "starting_after", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0}}]
METADATA = {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string", "maxLength": 512}}
ITEMS = {"type": "array", "maxItems": 20, "items": {"type": "object"}, "description": "Items as a response's input takes them"}
CONVERSATION_REQUEST = {"type": "object", "properties": {"items": ITEMS, "metadata": METADATA}}


def build_spec() -> dict[str, Any]:
    """The OpenAPI document."""
    schemas: dict[str, Any] = {"Error": ERROR, "ResponsesRequest": RESPONSES_REQUEST, "EmbeddingsRequest": EMBEDDINGS_REQUEST}
    for model in (ChatCompletionRequest, CompletionRequest, WarmRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return {
        "openapi": "3.1.0",
        "info": {"title": "KVStream", "version": __version__, "description": "OpenAI-compatible proxy with KV-aware scheduling."},
        "paths": {
            "/v1/chat/completions": _generation("ChatCompletionRequest", "Chat completion"),
            "/v1/completions": _generation("CompletionRequest", "Text completion"),
            "/v1/responses": _generation("ResponsesRequest",
                                         "OpenAI's Responses API (answered by KVStream in front of the in-process engine and "
                                         "Ollama; passed through to a runtime that speaks OpenAI)"),
            "/v1/embeddings": {
                "post": {
                    "summary": "Embeddings (computed by the in-process engine; passed through to a runtime)",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EmbeddingsRequest"}}}},
                    "responses": {"200": _json("object list, data (index, embedding), model, usage"),
                                  **_errors(400, 401, 404, 413, 429, 501, 502, 503)},
                }
            },
            "/v1/responses/{response_id}": {
                "get": {"summary": "A stored response (a background one as it stands)", "parameters": [RESPONSE_ID, *STREAM_AGAIN],
                        "responses": {"200": {"description": "The response, or with stream=true a background response's "
                                              "events again (server-sent events)",
                                              "content": {"application/json": {"schema": {"type": "object"}},
                                                          "text/event-stream": {"schema": {"type": "string"}}}},
                                      **_errors(400, 401, 404)}},
                "delete": {"summary": "Delete a stored response", "parameters": [RESPONSE_ID],
                           "responses": {"200": _json("id, object, deleted"), **_errors(401, 404)}},
            },
            "/v1/responses/{response_id}/cancel": {
                "post": {"summary": "Cancel a background response", "parameters": [RESPONSE_ID],
                         "responses": {"200": _json("The response, cancelled"), **_errors(400, 401, 404)}},
            },
            "/v1/responses/{response_id}/input_items": {
                "get": {"summary": "The items a stored response was made from", "parameters": [RESPONSE_ID, *PAGE],
                        "responses": {"200": _json("A list page of items"), **_errors(400, 401, 404)}},
            },
            "/v1/conversations": {
                "post": {"summary": "A new conversation (where KVStream answers the Responses API)",
                         "requestBody": {"required": False, "content": {"application/json": {"schema": CONVERSATION_REQUEST}}},
                         "responses": {"200": _json("The conversation"), **_errors(400, 401, 413)}},
            },
            "/v1/conversations/{conversation_id}": {
                "get": {"summary": "A conversation", "parameters": [CONVERSATION_ID],
                        "responses": {"200": _json("The conversation"), **_errors(401, 404)}},
                "post": {"summary": "Replace a conversation's metadata", "parameters": [CONVERSATION_ID],
                         "requestBody": {"required": True, "content": {"application/json": {"schema": {
                             "type": "object", "required": ["metadata"], "properties": {"metadata": METADATA}}}}},
                         "responses": {"200": _json("The conversation"), **_errors(400, 401, 404, 413)}},
                "delete": {"summary": "Delete a conversation", "parameters": [CONVERSATION_ID],
                           "responses": {"200": _json("id, object, deleted"), **_errors(401, 404)}},
            },
            "/v1/conversations/{conversation_id}/items": {
                "get": {"summary": "A conversation's items, a page at a time", "parameters": [CONVERSATION_ID, *PAGE],
                        "responses": {"200": _json("A list page of items"), **_errors(400, 401, 404)}},
                "post": {"summary": "Add items to a conversation", "parameters": [CONVERSATION_ID],
                         "requestBody": {"required": True, "content": {"application/json": {"schema": {
                             "type": "object", "required": ["items"], "properties": {"items": ITEMS}}}}},
                         "responses": {"200": _json("The items added"), **_errors(400, 401, 404, 413)}},
            },
            "/v1/warm": {
                "post": {
                    "summary": "Prefill a prefix so later requests find it cached (KVStream's own route)",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/WarmRequest"}}}},
                    "responses": {"200": _json("prompt_tokens, cached_tokens, elapsed_ms"), **_errors(400, 401, 404, 413, 429, 502, 503, 504)},
                }
            },
            "/v1/models": {"get": {"summary": "Models", "responses": {"200": _json("The runtime's models"), **_errors(401, 502, 503)}}},
            "/v1/models/{model}": {
                "get": {
                    "summary": "One model",
                    "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {"200": _json("The model"), **_errors(401, 404, 502, 503)},
                }
            },
            "/health": {"get": {"summary": "Liveness", "responses": {"200": _json("The process answers")}}},
            "/ready": {"get": {"summary": "Readiness", "responses": {"200": _json("The runtime answers"), "503": _json("The runtime does not answer"), **_errors(401)}}},
            "/status": {"get": {"summary": "Snapshot", "responses": {"200": _json("Queue, KV pool, counters"), **_errors(401)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics: KVStream's series, then the runtime's own", "responses": {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(401)}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": _json("OpenAPI 3.1")}}},
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "Only when server.api_keys is set"}},
        },
    }
