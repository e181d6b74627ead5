"""OpenAI's Conversations API (``client.conversations`` and ``.items``), where KVStream
answers the Responses API itself (conversation_store.py keeps them; a response made with
``conversation`` reads its items and adds its own: routes_responses.py). Where the Responses
API passes through to the runtime, so do these routes."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvstream.api.conversation_store import MAX_METADATA, Conversation, ConversationStore
from kvstream.api.errors import APIError, counted
from kvstream.api.listing import page
from kvstream.api.responses_format import chat_body, stored_items
from kvstream.api.routes_openai import read_object
from kvstream.api.routes_passthrough import unless_forwarded
from kvstream.api.state import CACHE_SALT, STATE

routes = web.RouteTableDef()
MAX_ADDED = 20  # items a create may carry, as OpenAI's


def _store(request: web.Request) -> ConversationStore:
    return request.app[STATE].conversations


def _conversation(request: web.Request) -> Conversation:
    conversation_id = request.match_info["conversation_id"]
    conversation = _store(request).get(request.get(CACHE_SALT), conversation_id)
    if conversation is None:
        raise APIError(404, f"Conversation with id '{conversation_id}' not found.", param="conversation_id", code="not_found")
    return conversation


def _metadata(value: Any) -> dict[str, str]:
    """OpenAI's metadata: at most 16 string pairs, keys of up to 64 characters, values of 512."""
    if value is None:
        return {}
    if (not isinstance(value, dict) or len(value) > MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items())):
        raise APIError(400, "Invalid 'metadata': at most 16 pairs of strings, keys up to 64 characters, values up to 512.",
                       param="metadata", code="invalid_value")
    return value


def _items(value: Any) -> list[dict[str, Any]]:
    """Items to add (at most MAX_ADDED), checked as a response's ``input`` items are; each
    given an ``id``."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_ADDED:
        raise APIError(400, f"Invalid 'items': expected a list of at most {MAX_ADDED} items.", param="items",
                       code="invalid_value")
    if not value:
        return []
    try:
        chat_body({"input": value})
    except APIError as exc:
        exc.param = (exc.param or "").replace("input", "items", 1) or "items"
        exc.message = exc.message.replace("'input", "'items")
        raise
    return list(stored_items(value))


@routes.post("/v1/conversations")
@counted("conversations")
@unless_forwarded
async def create(request: web.Request) -> web.StreamResponse:
    """``client.conversations.create(items=..., metadata=...)``."""
    store = _store(request)
    if not store.enabled:
        raise APIError(400, "This server stores no conversations (server.responses_max_stored is 0).", code="invalid_value")
    body = await read_object(request)
    metadata, items = _metadata(body.get("metadata")), _items(body.get("items"))
    return web.json_response(store.create(request.get(CACHE_SALT), metadata, items).public())


@routes.get("/v1/conversations/{conversation_id}")
@counted("conversations")
@unless_forwarded
async def retrieve(request: web.Request) -> web.StreamResponse:
    return web.json_response(_conversation(request).public())


@routes.post("/v1/conversations/{conversation_id}")
@counted("conversations")
@unless_forwarded
async def update(request: web.Request) -> web.StreamResponse:
    """``client.conversations.update(id, metadata=...)``: the metadata replaced."""
    conversation = _conversation(request)
    body = await read_object(request)
    if "metadata" not in body:
        raise APIError(400, "Missing required parameter: 'metadata'.", param="metadata", code="missing_required_parameter")
    _store(request).set_metadata(conversation, _metadata(body["metadata"]))
    return web.json_response(conversation.public())


@routes.delete("/v1/conversations/{conversation_id}")
@counted("conversations")
@unless_forwarded
async def delete(request: web.Request) -> web.StreamResponse:
    """``client.conversations.delete(id)``: its items go with it (responses made in it stay)."""
    conversation = _conversation(request)
    _store(request).delete(request.get(CACHE_SALT), conversation.id)
    return web.json_response({"id": conversation.id, "object": "conversation.deleted", "deleted": True})


@routes.get("/v1/conversations/{conversation_id}/items")
@counted("conversations")
@unless_forwarded
async def list_items(request: web.Request) -> web.StreamResponse:
    """``client.conversations.items.list(id, limit=, order=, after=)``: newest first by default."""
    return web.json_response(page(request, _conversation(request).items, "desc"))


@routes.post("/v1/conversations/{conversation_id}/items")
@counted("conversations")
@unless_forwarded
async def add_items(request: web.Request) -> web.StreamResponse:
    """``client.conversations.items.create(id, items=[...])``: the items added, as a list."""
    conversation = _conversation(request)
    body = await read_object(request)
    items = _items(body.get("items"))
    if not items:
        raise APIError(400, "Invalid 'items': expected at least one item.", param="items", code="invalid_value")
    _store(request).add(conversation, items)
    return web.json_response({"object": "list", "data": items, "first_id": items[0]["id"], "last_id": items[-1]["id"],
                              "has_more": False})


@routes.get("/v1/conversations/{conversation_id}/items/{item_id}")
@counted("conversations")
@unless_forwarded
async def retrieve_item(request: web.Request) -> web.StreamResponse:
    item_id = request.match_info["item_id"]
    for item in _conversation(request).items:
        if item.get("id") == item_id:
            return web.json_response(item)
    raise APIError(404, f"Item with id '{item_id}' not found.", param="item_id", code="not_found")


@routes.delete("/v1/conversations/{conversation_id}/items/{item_id}")
@counted("conversations")
@unless_forwarded
async def delete_item(request: web.Request) -> web.StreamResponse:
    """``client.conversations.items.delete(item_id, conversation_id=...)``: the conversation."""
    conversation = _conversation(request)
    if not _store(request).remove_item(conversation, request.match_info["item_id"]):
        raise APIError(404, f"Item with id '{request.match_info['item_id']}' not found.", param="item_id", code="not_found")
    return web.json_response(conversation.public())
