"""OpenAI's Responses API, ``POST /v1/responses``: what ``client.responses.create``,
``.stream`` and ``.parse`` send. Passed through to a runtime that speaks OpenAI, answered on
the chat route's path in front of the in-process engine and Ollama (translated_api.py); the
translation is responses_format.py."""

from __future__ import annotations

from aiohttp import web

from kvstream.api.errors import APIError, counted
from kvstream.api.responses_format import ResponseAnswer, chat_body, response_param
from kvstream.api.translated_api import TranslatedAPI, count, serve

routes = web.RouteTableDef()


def _shaped(error: APIError) -> APIError:
    """An error whose ``param`` names a chat field, renamed to the Responses field."""
    error.param = response_param(error.param)
    return error


def _invalid(chat_field: str | None, message: str) -> APIError:
    field = response_param(chat_field)
    return APIError(400, f"Invalid value for '{field}': {message}." if field else f"{message}.", param=field, code="invalid_value")


RESPONSES = TranslatedAPI(chat_body=chat_body, answer=ResponseAnswer, error_shape=_shaped, invalid=_invalid,
                          counted=lambda tokens: {"object": "response.input_tokens", "input_tokens": tokens}, count_defaults={})


@counted("responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    return await serve(request, RESPONSES)


@counted("responses_input_tokens")
async def count_input_tokens(request: web.Request) -> web.StreamResponse:
    """OpenAI's ``POST /v1/responses/input_tokens``: the input's size in tokens."""
    return await count(request, RESPONSES)


for _path in ("/v1/responses", "/responses"):
    routes.post(_path)(create_response)
    routes.post(_path + "/input_tokens")(count_input_tokens)
