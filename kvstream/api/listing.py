"""A page of a list as OpenAI's list routes answer one (``limit``, ``order``, ``after``;
``{"object": "list", "data", "first_id", "last_id", "has_more"}``): stored responses' input
items and conversations' items."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvstream.api.errors import APIError

MAX_LISTED = 100  # the largest page, as OpenAI's


def page(request: web.Request, items: list[dict[str, Any]], default_order: str) -> dict[str, Any]:
    """A list page of ``items`` as the query asks (``limit``, ``order``, ``after``)."""
    raw = request.query.get("limit", "20")
    limit = int(raw) if raw.isdigit() else 0
    if not 1 <= limit <= MAX_LISTED:
        raise APIError(400, f"Invalid 'limit': expected an integer from 1 to {MAX_LISTED}, got {raw!r}.", param="limit",
                       code="invalid_value")
    order = request.query.get("order", default_order)
    if order not in ("asc", "desc"):
        raise APIError(400, f"Invalid 'order': expected 'asc' or 'desc', got {order!r}.", param="order", code="invalid_value")
    ordered = items if order == "asc" else items[::-1]
    after = request.query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise APIError(400, f"Invalid 'after': no item '{after}' here.", param="after", code="invalid_value")
        ordered = ordered[ids.index(after) + 1:]
    taken = ordered[:limit]
    return {"object": "list", "data": taken, "first_id": taken[0]["id"] if taken else None,
            "last_id": taken[-1]["id"] if taken else None, "has_more": len(ordered) > limit}
