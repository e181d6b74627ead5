"""OpenAI's Responses API, ``POST /v1/responses``: what ``client.responses.create``,
``.stream`` and ``.parse`` send. Passed through to a runtime that speaks OpenAI, answered on
the chat route's path in front of the in-process engine and Ollama (translated_api.py); the
translation is responses_format.py. Its token count is ``POST /v1/responses/input_tokens``."""

from __future__ import annotations

from kvstream.api.errors import APIError
from kvstream.api.responses_format import ResponseAnswer, chat_body, response_param
from kvstream.api.translated_api import TranslatedAPI, api_routes


def _shaped(error: APIError) -> APIError:
    """An error whose ``param`` names a chat field, renamed to the Responses field."""
    error.param = response_param(error.param)
    return error


def _invalid(chat_field: str | None, message: str) -> APIError:
    field = response_param(chat_field)
    return APIError(400, f"Invalid value for '{field}': {message}." if field else f"{message}.", param=field, code="invalid_value")


RESPONSES = TranslatedAPI(chat_body=chat_body, answer=ResponseAnswer, error_shape=_shaped, invalid=_invalid,
                          counted=lambda tokens: {"object": "response.input_tokens", "input_tokens": tokens}, count_defaults={})


routes = api_routes(RESPONSES, "responses", ("/v1/responses", "/responses"), "/input_tokens")
