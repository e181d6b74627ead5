"""llama-server's native completion API in KVStream's terms: its body read as a
GenerateRequest, and each generation answered as llama-server answers ``/completion``.

What is read (llama-server's names and defaults, so that a body means what it means there):
``prompt`` as a text, token ids, a sequence mixing both, ``{"prompt_string": ...}``, or a
list of such prompts (a batch, answered with a list); ``n_predict`` (-1: until the end of
the text or of the context; 0: the prompt is computed into the prefix cache and nothing is
generated), ``temperature`` (0.8; <= 0 is greedy), ``top_k`` (40), ``top_p`` (0.95),
``min_p`` (0.05), ``typical_p``, ``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``,
``frequency_penalty``, ``seed`` (-1: random, even where the server has a seed), ``stop``,
``ignore_eos`` (the model's end tokens banned), ``logit_bias`` (its list form, a token as its
id or a text, and OpenAI's object of ids; ``false`` bans a token), ``n_probs`` (each token's
log-probability and its n most likely alternatives, ``completion_probabilities``; with
``post_sampling_probs`` the probabilities of the distribution it was drawn from),
``json_schema``, ``grammar`` (GBNF, the engine's grammar.py), ``return_tokens``,
``response_fields`` and ``stream``; streamed, ``timings_per_token`` (each partial object with
the timings so far) and ``return_progress`` (partial objects reporting the prompt's
computation, ``prompt_progress``, before the first token). Slot and cache controls
(``cache_prompt``, ``id_slot``, ``n_keep``, ``n_cache_reuse``, ``t_max_predict_ms``,
``samplers``...) change nothing about the tokens here and are taken as given. Samplers the
engine does not have (``mirostat``, DRY, XTC, ``top_n_sigma``, dynamic temperature),
``lora``, media and ``n_cmpl`` are a 400 naming the field when set to a value that turns
them on, never dropped.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstream.api import llama_timings
from kvstream.api.errors import APIError
from kvstream.api.schemas import MAX_BATCH_PROMPTS
from kvstream.samplers import OFF_WHEN
from kvstream.types import GenerateRequest, InfillParts, Token, TokenLogprob

if TYPE_CHECKING:
    from kvstream.engine import Generation

# llama-server's sampling defaults (common/common.h), used where the body leaves one out.
DEFAULTS: dict[str, Any] = {
    "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0, "repeat_penalty": 1.0,
    "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0,
}
# The seed llama-server reports for a random one (LLAMA_DEFAULT_SEED).
RANDOM_SEED = 0xFFFFFFFF
# Fields that change the tokens in a way the engine cannot, and when a value leaves them off
# (llama.cpp's samplers do nothing at these values; clients such as its web UI send them):
# the engine's missing samplers (samplers.py) and llama-server's own extras.
INACTIVE: dict[str, Callable[[Any], bool]] = {
    **OFF_WHEN, "lora": lambda v: v == [], "n_cmpl": lambda v: v == 1,
}
MAX_N_PROBS = 20  # the engine's most alternatives per token
BANNED = -100.0  # the engine's lowest logit bias: never drawn (llama-server's false, its -inf)


@dataclass(frozen=True)
class ServerDefaults:
    """What the server gives a body that sets neither (``--default-max-tokens``, ``--seed``):
    reported in ``/props`` and each answer's ``generation_settings``; None: none."""

    n_predict: int | None = None
    seed: int | None = None


# llama-server's error types by status (format_error_response), where they differ from OpenAI's.
ERROR_TYPES = {501: "not_supported_error", 503: "unavailable_error"}


class LlamaCppError(APIError):
    """An error in llama-server's shape: ``{"error": {"code", "message", "type"}}``."""

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status) or super().body()["error"]["type"]
        return {"error": {"code": self.status, "message": self.message, "type": kind}}


def invalid(message: str, param: str | None = None) -> LlamaCppError:
    return LlamaCppError(400, message, param=param, code="invalid_value")


# ------------------------------------------------------------------ the body


def prompts(value: Any, tokenize: Callable[[str, bool], list[int]]) -> tuple[list[str | list[int]], bool]:
    """The body's prompts (a text or token ids each) and whether they are a batch, read as
    llama-server reads them: a text, token ids or a sequence mixing both is one prompt (its
    texts tokenized, the first with the tokenizer's specials: ``tokenize(text, first)``); any
    other list is a batch of such prompts."""
    if isinstance(value, str | dict):
        return [_one(value, tokenize)], False
    if not isinstance(value, list) or not value:
        raise invalid("'prompt' must be a text, token ids, a mix of both, or a non-empty list of those.", "prompt")
    if all(_is_id(p) or isinstance(p, str) for p in value) and any(_is_id(p) for p in value):
        return [_one(value, tokenize)], False
    if len(value) > MAX_BATCH_PROMPTS:
        raise invalid(f"At most {MAX_BATCH_PROMPTS} prompts in one request.", "prompt")
    return [_one(p, tokenize) for p in value], True


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one(value: Any, tokenize: Callable[[str, bool], list[int]]) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if value.get("multimodal_data"):
            raise LlamaCppError(400, "This model takes text only: 'multimodal_data' cannot be read.",
                                param="prompt", code="unsupported_content")
        text = value.get("prompt_string")
        if not isinstance(text, str):
            raise invalid("A prompt object needs 'prompt_string', a text.", "prompt")
        return text
    if isinstance(value, list) and value and all(_is_id(p) or isinstance(p, str) for p in value):
        ids: list[int] = []
        for i, part in enumerate(value):
            ids += tokenize(part, i == 0) if isinstance(part, str) else [part]
        if any(t < 0 for t in ids):
            raise invalid("Token ids are integers >= 0.", "prompt")
        return ids or _empty()
    raise invalid("Each prompt must be a text, token ids, a mix of both, or {\"prompt_string\": ...}.", "prompt")


def _empty() -> list[int]:
    raise invalid("A prompt of no tokens cannot be completed.", "prompt")


def _number(body: dict[str, Any], name: str, low: float | None = None, high: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"'{name}' must be a number.", name)
    if value != value:  # NaN (Python's json reads it; llama-server's parser refuses it), past any range check
        raise invalid(f"'{name}' must be a number, not NaN.", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise invalid(f"'{name}' must be within [{low}, {high}], not {value}.", name)
    return value


def _integer(body: dict[str, Any], name: str, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_id(value):
        raise invalid(f"'{name}' must be an integer.", name)
    if low is not None and value < low:
        raise invalid(f"'{name}' must be at least {low}, not {value}.", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be true or false.", name)
    return value


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop' must be a list of texts.", "stop")
    return [s for s in stops if s]


def _logit_bias(value: Any, tokenize: Callable[[str, bool], list[int]]) -> dict[str, float]:
    """llama-server's ``logit_bias``: ``[[token, bias], ...]`` (a token as its id or a text,
    every token of the text biased) or ``{"id" or "text": bias}``; a bias of ``false`` bans
    the token.
    As the engine's ``logit_bias`` (OpenAI's object of ids)."""
    if value is None:
        return {}
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, list) or not all(isinstance(p, list | tuple) and len(p) == 2 for p in pairs):
        raise invalid("'logit_bias' must be a list of [token, bias] pairs or an object of token ids to biases.", "logit_bias")
    bias: dict[str, float] = {}
    for token, amount in pairs:
        if amount is False:
            amount = BANNED
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount != amount:  # (NaN)
            raise invalid("A 'logit_bias' bias is a number, or false to ban the token.", "logit_bias")
        # A text is each of its tokens; an object's keys are ids where they are numbers.
        if isinstance(token, str) and not (isinstance(value, dict) and token.strip().isdigit()):
            ids = tokenize(token, False)
        else:
            try:
                ids = [int(token)]
            except (TypeError, ValueError):
                raise invalid(f"{token!r} in 'logit_bias' is not a token.", "logit_bias") from None
        for token_id in ids:
            bias[str(token_id)] = max(-100.0, min(100.0, float(amount)))
    return bias


def generate_request(body: dict[str, Any], prompt: str | list[int], request_id: str,
                     tokenize: Callable[[str, bool], list[int]], end_ids: tuple[int, ...] = ()) -> GenerateRequest:
    """The GenerateRequest ``body`` asks for ``prompt`` (one of ``prompts``); LlamaCppError
    (400) for a value it cannot take. ``end_ids``: the model's end-of-generation tokens,
    which ``ignore_eos`` bans: llama-server's meaning (on the OpenAI routes, vLLM's: an end
    token may be drawn, and the answer goes on past it)."""
    for name, inactive in INACTIVE.items():
        if body.get(name) is not None and not inactive(body[name]):
            raise LlamaCppError(400, f"'{name}' is not supported by the in-process engine (only at a value that turns "
                                f"it off), not {body[name]!r}.", param=name, code="unsupported_parameter")
    n_predict = _integer(body, "n_predict", -1)
    if n_predict is None:
        n_predict = _integer(body, "max_tokens", -1)  # llama-server reads it as n_predict's other name
    temperature = _number(body, "temperature")
    top_p = _number(body, "top_p", 0, 1)
    top_k = _integer(body, "top_k")
    seed = _integer(body, "seed", -1)
    n_probs = _integer(body, "n_probs", 0) or 0
    if n_probs > MAX_N_PROBS:
        raise LlamaCppError(400, f"'n_probs' is at most {MAX_N_PROBS} here.", param="n_probs", code="invalid_value")
    extra: dict[str, Any] = {}
    for name, low, high in (("min_p", 0, 1), ("typical_p", 0, 1), ("repeat_penalty", 0, None),
                            ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
        value = _number(body, name, low, high)
        extra[name] = DEFAULTS[name] if value is None else value
    repeat_last_n = _integer(body, "repeat_last_n", -1)
    extra["repeat_last_n"] = DEFAULTS["repeat_last_n"] if repeat_last_n is None else repeat_last_n
    extra["ignore_eos"] = _flag(body, "ignore_eos")
    extra["post_sampling_probs"] = _flag(body, "post_sampling_probs")
    bias = _logit_bias(body.get("logit_bias"), tokenize)
    if extra["ignore_eos"]:
        bias |= {str(token_id): BANNED for token_id in end_ids}
    if bias:
        extra["logit_bias"] = bias
    if body.get("grammar") not in (None, ""):  # GBNF, read by the engine (guided.py): a 400 if it cannot be
        extra["grammar"] = body["grammar"]
    for name in ("grammar_lazy", "grammar_triggers", "preserved_tokens"):  # (request_options.py reads them)
        if body.get(name) is not None:
            extra[name] = body[name]
    schema = body.get("json_schema")
    if schema is not None and schema != {}:
        if not isinstance(schema, dict):
            raise invalid("'json_schema' must be a JSON schema object.", "json_schema")
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    request = GenerateRequest(
        model=body.get("model") if isinstance(body.get("model"), str) and body.get("model") else None,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt if isinstance(prompt, list) else None,
        max_tokens=None if n_predict in (None, -1) else n_predict,
        temperature=DEFAULTS["temperature"] if temperature is None else max(0.0, temperature),
        top_p=DEFAULTS["top_p"] if top_p is None else top_p,
        top_k=DEFAULTS["top_k"] if top_k is None else max(0, top_k),
        # -1 asks for a random seed, as at llama-server, even where the server has one of
        # its own (which a body that sets none gets): drawn here.
        seed=random.getrandbits(32) if seed == -1 else seed,
        stop=_stops(body.get("stop")),
        extra=extra,
        request_id=request_id,
        logprobs=n_probs or None,
        stream=_flag(body, "stream"),
    )
    request.return_progress = request.stream and llama_timings.wants(body, "return_progress")
    if request.max_tokens == 0:
        # Only the prompt, into the prefix cache: the engine computes it as an echo of it
        # with nothing generated (the echo itself is not answered).
        request.echo = True
    return request


def infill_parts(body: dict[str, Any]) -> InfillParts:
    """``/infill``'s parts: ``input_prefix`` and ``input_suffix`` (required), ``prompt`` (the
    start of the line being written, after the prefix), ``input_extra`` (other files, a list
    of ``{"text", "filename"}``, the name "tmp" where none is given) and ``n_predict``; 400
    in llama-server's words for what it refuses."""
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise invalid(f'"{name}" is required', name)
        if not isinstance(body[name], str):
            raise invalid(f'"{name}" must be a string', name)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise invalid('"prompt" must be a string', "prompt")
    chunks = body.get("input_extra", [])
    if not isinstance(chunks, list):
        raise invalid('"input_extra" must be an array of {"filename": string, "text": string}', "input_extra")
    other_files = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise invalid('extra_context chunk must contain a "text" field with a string value', "input_extra")
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise invalid('extra_context chunk\'s "filename" field must be a string', "input_extra")
        other_files.append((name, chunk["text"]))
    n_predict = _integer(body, "n_predict", -1)
    return InfillParts(body["input_prefix"], body["input_suffix"], prompt, tuple(other_files),
                       -1 if n_predict is None else n_predict)


def default_settings(server: ServerDefaults) -> dict[str, Any]:
    """The sampling a body that sets nothing gets (``/props``' ``default_generation_settings``
    ``params``): llama-server's defaults, its samplers this engine lacks at the values that
    turn them off, and the server's own defaults."""
    limit = -1 if server.n_predict is None else server.n_predict
    return {
        "seed": RANDOM_SEED if server.seed is None else server.seed, **DEFAULTS, "n_predict": limit, "max_tokens": limit,
        "ignore_eos": False, "stream": False,
        "n_probs": 0, "stop": [], "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1.0,
        "dynatemp_range": 0.0, "post_sampling_probs": False, "lora": [],
        "samplers": ["penalties", "temperature", "top_k", "typ_p", "top_p", "min_p"],  # the engine's order
    }


# ------------------------------------------------------------------ the answer


class CompletionAnswer:
    """One prompt's answer as llama-server gives it: built token by token; streamed, each
    token as a partial object, then the final one (``stop: true``) with the settings, the
    stop's kind and the timings."""

    def __init__(self, request: GenerateRequest, body: dict[str, Any], model: str, index: int = 0,
                 server: ServerDefaults = ServerDefaults()) -> None:
        self.request, self.model, self.index = request, model, index
        # The settings as they applied: the server's defaults where the body set none.
        limit = server.n_predict if request.max_tokens is None else request.max_tokens
        seed = server.seed if request.seed is None else request.seed
        self.n_predict = -1 if limit is None else limit
        self.seed = RANDOM_SEED if seed is None or body.get("seed") == -1 else seed
        self.return_tokens = body.get("return_tokens") is True
        self.post_sampling = request.extra.get("post_sampling_probs") is True
        self.fields = body.get("response_fields") if isinstance(body.get("response_fields"), list) else []
        # Streamed: each partial object with the timings so far (``timings_per_token``).
        self.timings_per_token = llama_timings.wants(body, "timings_per_token")
        self.content: list[str] = []
        self.tokens: list[int] = []
        self.probabilities: list[dict[str, Any]] = []

    def add(self, token: Token, gen: Generation) -> dict[str, Any] | None:
        """Take one token of ``gen``; the partial object a stream sends for it (None: nothing
        to send)."""
        if token.echo:  # n_predict 0: the prompt alone, not answered
            return None
        prompt_tokens = len(gen.seq.prompt_token_ids)
        if token.progress is not None:  # return_progress: how far the prompt is computed
            report = {"index": self.index, "content": "", "tokens": [], "stop": False, "id_slot": 0, "tokens_predicted": 0,
                      "tokens_evaluated": prompt_tokens, "prompt_progress": token.progress.as_json()}
            if self.timings_per_token:
                report["timings"] = llama_timings.progress_timings(token.progress)
            return report
        ids = [token.token_id] if token.token_id is not None else []
        self.content.append(token.text)
        self.tokens += ids
        probabilities = [_probability(entry, self.post_sampling) for entry in token.token_logprobs or ()] if self.request.logprobs else []
        self.probabilities += probabilities
        if not token.text and not ids:
            return None
        partial = {"index": self.index, "content": token.text, "tokens": ids, "stop": False, "id_slot": 0,
                   "tokens_predicted": len(self.tokens), "tokens_evaluated": prompt_tokens}
        if probabilities:
            partial["completion_probabilities"] = probabilities
        if self.timings_per_token:
            partial["timings"] = llama_timings.of_generation(gen)
        return partial

    def final(self, last: Token, gen: Generation, prompt_text: str, streamed: bool) -> dict[str, Any]:
        """The final object of ``gen`` (streamed: without the content and tokens already sent)."""
        usage = gen.usage
        prompt_n = usage.prompt_tokens if usage is not None else 0
        predicted = usage.completion_tokens if usage is not None else len(self.tokens)
        content = "".join(self.content)
        request = self.request
        if last.finish_reason == "length":
            stop_type = "limit"
        elif last.stop_sequence:
            stop_type = "word"
        else:
            stop_type = "eos"
        whole: dict[str, Any] = {
            "index": self.index,
            "content": "" if streamed else content,
            "tokens": [] if streamed or not self.return_tokens else self.tokens,
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": predicted,
            "tokens_evaluated": prompt_n,
            "generation_settings": {
                "n_predict": self.n_predict, "seed": self.seed,
                "temperature": request.temperature, "top_k": request.top_k, "top_p": request.top_p,
                **{name: request.extra[name] for name in ("min_p", "typical_p", "repeat_last_n", "repeat_penalty",
                                                          "presence_penalty", "frequency_penalty", "ignore_eos")},
                "stop": list(request.stop), "n_probs": request.logprobs or 0,
                "post_sampling_probs": self.post_sampling, "stream": request.stream,
                # llama-server's form: a ban (its -inf) is null.
                "logit_bias": [{"bias": None if v <= BANNED else v, "token": int(k)}
                               for k, v in request.extra.get("logit_bias", {}).items()],
                "json_schema": request.extra.get("response_format", {}).get("json_schema", {}).get("schema", {}),
                "grammar": request.extra.get("grammar", ""),
                "grammar_lazy": request.extra.get("grammar_lazy", False),
                "grammar_triggers": request.extra.get("grammar_triggers", []),
            },
            "prompt": prompt_text,
            "has_new_line": "\n" in content,
            "truncated": False,  # a prompt past the context is a 400 here, never cut
            "stop_type": stop_type,
            "stopping_word": last.stop_sequence or "",
            "tokens_cached": prompt_n + predicted,
            "timings": llama_timings.of_generation(gen),
        }
        if request.logprobs and not streamed:
            whole["completion_probabilities"] = self.probabilities
        return _selected(whole, self.fields) if self.fields else whole


def _probability(entry: TokenLogprob, post_sampling: bool) -> dict[str, Any]:
    """One token of ``completion_probabilities``: log-probabilities of the model's
    distribution, or (``post_sampling_probs``) probabilities of the one it was drawn from."""
    def one(e: TokenLogprob) -> dict[str, Any]:
        value = {"prob": math.exp(e.logprob)} if post_sampling and e.logprob is not None else {"logprob": e.logprob}
        return {"id": e.token_id, "token": e.token, **value, "bytes": e.bytes}

    alternatives = [one(alternative) for alternative in entry.top]
    return one(entry) | ({"top_probs": alternatives} if post_sampling else {"top_logprobs": alternatives})


def _selected(whole: dict[str, Any], fields: list[Any]) -> dict[str, Any]:
    """``response_fields``: only the fields named, a nested one by its path (``a/b``), under
    the name given; a name that is not there is left out."""
    out = {}
    for name in fields:
        if not isinstance(name, str):
            continue
        value: Any = whole
        for part in name.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[name] = value
    return out
