"""OpenAI's Responses API, ``POST /v1/responses``: what ``client.responses.create``,
``.stream`` and ``.parse`` send. Passed through to a runtime that speaks OpenAI, answered on
the chat route's path in front of the in-process engine and Ollama (translated_api.py); the
translation is responses_format.py. Its token count is ``POST /v1/responses/input_tokens``.

Where KVStream answers, it keeps what it answered (response_store.py) unless the body says
``store: false``: ``previous_response_id`` continues a stored response, an
``item_reference`` input item stands for a stored item, ``conversation`` reads a
conversation's items first and adds the response's to it (routes_conversations.py), and
``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read and
delete them (``client.responses.retrieve``, ``.delete``, ``.input_items.list``). A
``background`` response runs on without its request (background.py): read while it runs,
streamed again from any event (``retrieve(id, stream=True, starting_after=N)``) and
cancelled (``.cancel``). Where the route passes through, these do too: the runtime's
responses are its own."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from kvstream.api.background import BACKGROUND, BackgroundRun
from kvstream.api.conversation_store import Conversation
from kvstream.api.errors import REQUEST_ID, APIError, counted
from kvstream.api.listing import page
from kvstream.api.response_store import ResponseStore, StoredResponse
from kvstream.api.responses_format import ResponseAnswer, chat_body, continuation, response_param, stored_items
from kvstream.api.routes_passthrough import unless_forwarded
from kvstream.api.state import CACHE_SALT, KEY_IN_FLIGHT, STATE
from kvstream.api.streaming import GuardedResponse
from kvstream.api.translated_api import TranslatedAPI, api_routes, sse
from kvstream.engine import Generation, KVStreamEngine
from kvstream.types import GenerateRequest

# The stored items a request continues (empty for a new one), set by _prepare; and the
# conversation it is made in, if any.
CONTEXT = web.RequestKey("responses_context", tuple)
CONVERSATION = web.RequestKey("responses_conversation", object)


def _shaped(error: APIError) -> APIError:
    """An error whose ``param`` names a chat field, renamed to the Responses field."""
    error.param = response_param(error.param)
    return error


def _invalid(chat_field: str | None, message: str) -> APIError:
    field = response_param(chat_field)
    return APIError(400, f"Invalid value for '{field}': {message}." if field else f"{message}.", param=field, code="invalid_value")


def _store(request: web.Request) -> ResponseStore:
    return request.app[STATE].responses


def _prepare(request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
    """The body with the conversation its ``previous_response_id`` names put before its
    input; ``store`` false where nothing can be stored."""
    store = _store(request)
    if not store.enabled:
        body = body | {"store": False}
    if body.get("background") is True and body.get("store") is False:
        raise APIError(400, "A background response is kept to be read back: it needs 'store': true" + (
            "." if store.enabled else ", and storing is off on this server (server.responses_max_stored: 0)."),
            param="background", code="invalid_value")
    if isinstance(body.get("input"), list):
        body = body | {"input": [_referenced(request, item, i) for i, item in enumerate(body["input"])]}
    previous = body.get("previous_response_id")
    request[CONTEXT], request[CONVERSATION] = (), None
    if body.get("conversation") is not None:
        if previous is not None:
            raise APIError(400, "'previous_response_id' and 'conversation' cannot both be given.", param="conversation",
                           code="invalid_value")
        conversation = _conversation(request, body["conversation"])
        request[CONTEXT], request[CONVERSATION] = tuple(conversation.items), conversation
        return continuation(body | {"conversation": {"id": conversation.id}}, request[CONTEXT])
    if previous is None:
        return body
    if not isinstance(previous, str):
        raise APIError(400, "Invalid type for 'previous_response_id': expected a string.", param="previous_response_id",
                       code="invalid_type")
    if request.app[BACKGROUND].get(request.get(CACHE_SALT), previous) is not None:
        raise APIError(400, f"Previous response with id '{previous}' is still in progress: continue it once it has "
                       "ended.", param="previous_response_id", code="invalid_value")
    stored = store.get(request.get(CACHE_SALT), previous)
    if stored is None:
        raise APIError(400, f"Previous response with id '{previous}' not found.", param="previous_response_id",
                       code="previous_response_not_found")
    request[CONTEXT] = stored.conversation()
    return continuation(body, request[CONTEXT])


def _conversation(request: web.Request, named: Any) -> Conversation:
    """The requester's conversation ``named`` (its id, or ``{"id": ...}``); 400 if none, or
    if it holds the whole byte budget."""
    conversation_id = named.get("id") if isinstance(named, dict) else named
    if not isinstance(conversation_id, str):
        raise APIError(400, "Invalid type for 'conversation': expected a conversation id or {\"id\": ...}.",
                       param="conversation", code="invalid_type")
    store = request.app[STATE].conversations
    conversation = store.get(request.get(CACHE_SALT), conversation_id)
    if conversation is None:
        raise APIError(400, f"Conversation with id '{conversation_id}' not found.", param="conversation",
                       code="invalid_value")
    if store.full(conversation):
        raise APIError(400, f"Conversation '{conversation_id}' holds {conversation.size} bytes, the most this server "
                       "keeps (server.responses_max_bytes): start a new one.", param="conversation", code="invalid_value")
    return conversation


def _referenced(request: web.Request, item: Any, index: int) -> Any:
    """An ``item_reference`` input item as the stored item it names; any other as it is."""
    if not isinstance(item, dict) or item.get("type") != "item_reference":
        return item
    item_id = item.get("id")
    found = _store(request).find_item(request.get(CACHE_SALT), item_id) if isinstance(item_id, str) else None
    if found is None:
        raise APIError(400, f"Item with id {item_id!r} not found.", param=f"input[{index}].id", code="invalid_value")
    return found


def _own_items(request: web.Request, body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The prepared body's own input (after the conversation it continues) as stored items."""
    context = request[CONTEXT]
    return stored_items(body["input"][len(context):] if context else body["input"])


def _keeper(request: web.Request, body: dict[str, Any]) -> Callable[..., None]:
    """What keeps an answer to ``body``: stored unless the body said ``store: false`` (with
    the events it streamed, for a background response), and its input and output added to
    the conversation it was made in if the model finished it."""
    state, owner, context, conversation = request.app[STATE], request.get(CACHE_SALT), request[CONTEXT], request[CONVERSATION]
    own = _own_items(request, body)

    def keep(answer: dict[str, Any], events: tuple[dict[str, Any], ...] | None = None, finished: bool = True) -> None:
        if conversation is not None and finished:
            state.conversations.add(conversation, [*own, *answer["output"]])
        if body.get("store") is not False:
            state.responses.put(owner, answer, context, own, events)

    return keep


def _keep(request: web.Request, body: dict[str, Any], answer: dict[str, Any]) -> None:
    _keeper(request, body)(answer)


async def _detach(request: web.Request, body: dict[str, Any], gen: Generation, answer: Any) -> web.StreamResponse:
    """Start a background response: answered ``queued`` at once, or, with ``stream``, its
    events followed as they come (the run goes on if the client leaves)."""
    run = BackgroundRun(answer, request.get(CACHE_SALT), body.get("stream") is True, request[CONTEXT],
                        _own_items(request, body))
    run.publish(answer.queued())
    request.app[BACKGROUND].start(run, gen, _keeper(request, body), request.get(KEY_IN_FLIGHT))
    headers = {"X-Request-Id": request[REQUEST_ID]}
    if not run.streamed:
        return web.json_response(run.response(), headers=headers)
    return await _stream_events(request, run.follow(-1), headers)


async def _stream_events(request: web.Request, batches: AsyncIterator[list[dict[str, Any]]],
                         headers: dict[str, str]) -> web.StreamResponse:
    """A background response's events as server-sent events, a batch at a time."""
    out = GuardedResponse(headers=headers | {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                             "X-Accel-Buffering": "no"})
    await out.prepare(request)
    try:
        async with contextlib.aclosing(batches):
            async for batch in batches:
                await out.write(b"".join(sse(event) for event in batch))
        await out.write_eof()
    except ConnectionError:
        pass  # the client left; a background response runs on without it
    return out


async def _replay(events: tuple[dict[str, Any], ...], after: int) -> AsyncIterator[list[dict[str, Any]]]:
    yield list(events[max(after + 1, 0):])


async def _fit(engine: KVStreamEngine, generate: GenerateRequest, body: dict[str, Any]) -> None:
    """``truncation: "auto"``: while the prompt and ``max_output_tokens`` do not fit the
    context, drop the conversation's earliest items, as OpenAI does (the instructions stay,
    and a tool's result never opens what is kept); the fewest dropped that fit. None fitting
    leaves the shortest, whose 400 then says how far it is. ``disabled`` (the default):
    the request fails with the 400."""
    messages = generate.messages
    if body.get("truncation") != "auto" or not messages or await engine.fits(generate):
        return
    head = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
    cuts = [i for i in range(head + 1, len(messages)) if messages[i].get("role") != "tool"]
    if not cuts:
        return
    low, high = 0, len(cuts) - 1  # the first cut that fits: a later cut keeps less
    while low < high:
        middle = (low + high) // 2
        generate.messages = messages[:head] + messages[cuts[middle]:]
        if await engine.fits(generate):
            high = middle
        else:
            low = middle + 1
    generate.messages = messages[:head] + messages[cuts[low]:]


RESPONSES = TranslatedAPI(chat_body=chat_body, answer=ResponseAnswer, error_shape=_shaped, invalid=_invalid,
                          counted=lambda tokens: {"object": "response.input_tokens", "input_tokens": tokens}, count_defaults={},
                          prepare=_prepare, keep=_keep, detach=_detach, fit=_fit, turns_field="input",
                          timed_events=frozenset({"response.in_progress", "response.output_text.delta"}))


routes = api_routes(RESPONSES, "responses", ("/v1/responses", "/responses"), "/input_tokens")


def _stored(request: web.Request) -> StoredResponse:
    """The stored response the path names; 404 if the requester stored none by that id."""
    response_id = request.match_info["response_id"]
    stored = _store(request).get(request.get(CACHE_SALT), response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")
    return stored


def _running(request: web.Request) -> BackgroundRun | None:
    """The requester's background response the path names while it runs, else None."""
    return request.app[BACKGROUND].get(request.get(CACHE_SALT), request.match_info["response_id"])


def _starting_after(request: web.Request) -> int:
    raw = request.query.get("starting_after")
    if raw is None:
        return -1
    if not raw.isdigit():
        raise APIError(400, f"Invalid 'starting_after': expected an event's sequence number, got {raw!r}.",
                       param="starting_after", code="invalid_value")
    return int(raw)


@counted("responses_retrieve")
@unless_forwarded
async def retrieve(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}``: the response as it stands (a background one while it
    runs); with ``stream=true``, a background response created streamed, its events again
    from the one after ``starting_after``, live while it runs."""
    run = _running(request)
    stored = _stored(request) if run is None else None
    if request.query.get("stream", "false").lower() in ("false", "0"):
        return web.json_response(run.response() if run is not None else stored.response)  # type: ignore[union-attr]
    after = _starting_after(request)
    if run is not None and run.streamed:
        return await _stream_events(request, run.follow(after), {})
    if stored is not None and stored.events is not None:
        return await _stream_events(request, _replay(stored.events, after), {})
    raise APIError(400, "Only responses created with 'background: true' and 'stream: true' can be streamed again.",
                   param="stream", code="invalid_value")


@counted("responses_delete")
@unless_forwarded
async def delete(request: web.Request) -> web.StreamResponse:
    """``DELETE /v1/responses/{id}``: forget the response, cancelled first if it runs in the
    background (its continuations keep their conversation)."""
    response_id = request.match_info["response_id"]
    run = _running(request)
    if run is not None:
        await request.app[BACKGROUND].cancel(run)
    if not _store(request).delete(request.get(CACHE_SALT), response_id):
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


@counted("responses_input_items")
@unless_forwarded
async def input_items(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}/input_items``: the items the response was made from (the
    conversation it continued, then its own input), a page at a time (``limit``, ``order``
    ``desc`` by default, ``after`` an item id)."""
    run = _running(request)
    if run is not None:
        items = run.items
    else:
        stored = _stored(request)
        items = stored.context + stored.input_items
    return web.json_response(page(request, list(items), "desc"))


@counted("responses_cancel")
@unless_forwarded
async def cancel(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses/{id}/cancel``: stop a background response while it runs and
    answer it ``cancelled`` (again, for one already cancelled)."""
    run = _running(request)
    if run is not None:
        await request.app[BACKGROUND].cancel(run)
        return web.json_response(run.response())
    response = _stored(request).response
    if not response.get("background"):
        raise APIError(400, "Only responses created with 'background: true' can be cancelled.", code="invalid_value")
    if response["status"] != "cancelled":
        raise APIError(400, f"Cannot cancel a response whose status is '{response['status']}'.", code="invalid_value")
    return web.json_response(response)


for prefix in ("/v1/responses", "/responses"):
    routes.get(prefix + "/{response_id}")(retrieve)
    routes.delete(prefix + "/{response_id}")(delete)
    routes.get(prefix + "/{response_id}/input_items")(input_items)
    routes.post(prefix + "/{response_id}/cancel")(cancel)
