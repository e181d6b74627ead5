"""OpenAI's ``/v1/embeddings``.

With a runtime behind KVStream the route is the runtime's: the body passes through as sent
and is admitted like any forward pass (routes_passthrough). The in-process engine computes
embeddings itself (``serves_embeddings``: the decoder's last hidden state, mean-pooled and
unit-length); the request is checked here as OpenAI checks it, and answered in its shape,
``encoding_format`` ``float`` or ``base64`` (what the ``openai`` client asks for by
default). A backend with neither answers 501.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from aiohttp import web

from kvstream.api.errors import APIError, counted, from_exception
from kvstream.api.routes_openai import read_object, resolve_model, retry_after
from kvstream.api.routes_passthrough import forward
from kvstream.api.state import STATE, AppState
from kvstream.scheduler import SchedulerError
from kvstream.types import BackendError, Embeddings

routes = web.RouteTableDef()

MAX_INPUTS = 2048  # OpenAI's own limit of inputs per request


def openai_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's ``input``: a string, a list of strings, a list of token ids, or a list of
    lists of token ids; as a list of inputs. Raises APIError (400) for anything else."""
    def invalid(why: str) -> APIError:
        return APIError(400, f"Invalid value for 'input': {why}", param="input", code="invalid_value")

    def is_ids(item: Any) -> bool:
        return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)

    if isinstance(value, str):
        items: list[Any] = [value]
    elif is_ids(value) and value:
        items = [value]
    elif isinstance(value, list):
        items = value
        if not all(isinstance(item, str) for item in items) and not all(is_ids(item) for item in items):
            raise invalid("expected a string, a list of strings, a list of token ids or a list of lists of token ids.")
    else:
        raise invalid("expected a string, a list of strings, a list of token ids or a list of lists of token ids.")
    if not items:
        raise invalid("it is an empty list.")
    if len(items) > MAX_INPUTS:
        raise invalid(f"{len(items)} inputs, more than the {MAX_INPUTS} a request may carry.")
    if any(not item for item in items):
        raise invalid("an input is empty.")
    return items


def encoded(vector: list[float], encoding: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of little-endian float32."""
    return vector if encoding == "float" else base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def embed(state: AppState, inputs: list[str | list[int]], truncate: bool) -> Embeddings:
    """The in-process backend's embeddings, its errors as APIErrors."""
    try:
        return await state.engine.backend.embed(inputs, truncate=truncate)
    except (SchedulerError, BackendError) as exc:
        raise from_exception(exc, retry_after(state)) from None


def check_dimensions(value: Any, width: int | None) -> None:
    """``dimensions`` may only name the model's own width: its vectors are not trained to
    be cut shorter (as text-embedding-3's are). Checked before anything is computed."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value != width:
        said = f"this model's embeddings have {width} dimensions" if width else "this model's embeddings have their own width"
        raise APIError(400, f"Invalid value for 'dimensions': {said} and cannot be shortened.", param="dimensions",
                       code="invalid_value")


@routes.post("/v1/embeddings")
@counted(lambda request: "embeddings" if request.app[STATE].engine.backend.upstream() is None else "passthrough_generation")
async def embeddings(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    backend = state.engine.backend
    if backend.upstream() is not None:
        return await forward(request)
    if not backend.serves_embeddings:
        raise APIError(501, f"the {backend.name} backend does not serve embeddings", code="unsupported")
    body = await read_object(request)
    inputs = openai_inputs(body.get("input"))
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise APIError(400, "Invalid value for 'encoding_format': expected 'float' or 'base64'.", param="encoding_format",
                       code="invalid_value")
    name = body.get("model")
    model = await resolve_model(state, name) if isinstance(name, str) and name else backend.model
    check_dimensions(body.get("dimensions"), backend.embedding_width())
    result = await embed(state, inputs, truncate=False)
    return web.json_response({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v, encoding)} for i, v in enumerate(result.vectors)],
        "model": name if isinstance(name, str) and name else model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    })
