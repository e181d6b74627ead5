"""Anthropic's Messages API, ``POST /v1/messages``: what the ``anthropic`` SDK and the agents
built on it send. Passed through to a runtime that speaks OpenAI (llama-server serves
``/v1/messages`` itself), answered on the chat route's path in front of the in-process engine
and Ollama (translated_api.py), errors in Anthropic's shape; the translation is
messages_format.py. Its token count is ``POST /v1/messages/count_tokens``."""

from __future__ import annotations

from typing import Any

from kvstream.api.errors import APIError
from kvstream.api.messages_format import MessageAnswer, chat_body, messages_error
from kvstream.api.translated_api import TranslatedAPI, api_routes


def _invalid(chat_field: str | None, message: str) -> APIError:
    return messages_error(APIError(400, f"{chat_field}: {message}" if chat_field else message, param=chat_field))


def _answer(body: dict[str, Any], model: str) -> MessageAnswer:
    return MessageAnswer(model)


MESSAGES = TranslatedAPI(chat_body=chat_body, answer=_answer, error_shape=messages_error, invalid=_invalid,
                         counted=lambda tokens: {"input_tokens": tokens}, count_defaults={"max_tokens": 1},
                         turns_field="messages")


# (Anthropic's count route takes no max_tokens.)
routes = api_routes(MESSAGES, "messages", ("/v1/messages",), "/count_tokens")
