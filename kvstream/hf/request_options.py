"""The in-process engine's reading of a request's sampling and output fields.

In front of a runtime, the fields KVStream's schemas do not read (``GenerateRequest.extra``)
go to the runtime, which judges them. In-process, KVStream is the runtime: each field that
changes the answer is honoured here or refused with a 400 that names it, never dropped
silently (a client asking for JSON or for log-probabilities and getting neither would not
know). Fields that change nothing about the tokens (``user``, ``metadata``, ``store``...)
are accepted and ignored, as OpenAI-compatible servers do.

Honoured: ``GenerateRequest.logprobs`` (the schemas read OpenAI's ``logprobs`` /
``top_logprobs``, the Ollama route Ollama's), ``response_format`` ``json_object`` (JSON
mode) and ``json_schema`` (structured outputs; json_schema.py says what schemas it takes),
``tool_choice`` forcing a call (a schema too, tool_calls.py),
grammars and vLLM's guided decoding (guided.py), llama-server's lazy grammars
(``grammar_lazy``, ``grammar_triggers``: lazy_grammar.py) and ``preserved_tokens``,
``logit_bias``, ``presence_penalty``, ``frequency_penalty``,
and from Ollama's options (or llama-server's fields) ``repeat_penalty``, ``repeat_last_n``,
``min_p``, ``typical_p``, and ``ignore_eos`` (vLLM's and llama-server's); completions' ``echo``
(``GenerateRequest.echo``: with ``logprobs``, the prompt's tokens are scored too, and
``max_tokens`` may be 0) and ``best_of`` (``GenerateRequest.best_of``, best_of.py). Refused: a
schema outside what json_schema.py takes, ``echo`` or ``best_of`` in a chat request, samplers
and constraints it lacks set on (samplers.py: mirostat, DRY, XTC...), a grammar's token
reference the vocabulary has no such token for; a ``suffix`` is the backend's
(fill_in_middle.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvstream.hf.guided import Guide, guide
from kvstream.hf.json_schema import SchemaError, compile_schema
from kvstream.hf.lazy_grammar import PATTERN, PATTERN_FULL, TOKEN, WORD, Triggers, compile_trigger
from kvstream.hf.sampling import SamplingParams
from kvstream.hf.generic_calls import answer_schema
from kvstream.hf.tool_calls import forced_call_schema, holdable_tools
from kvstream.samplers import first_unsupported
from kvstream.types import BackendRejected, GenerateRequest

LOGIT_BIAS_LIMIT = 100.0


def _number(extra: dict[str, Any], name: str, default: float, low: float | None = None, high: float | None = None) -> float:
    value = extra.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BackendRejected(f"Invalid type for '{name}': expected a number.", param=name, code="invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        raise BackendRejected(f"Invalid value for '{name}': {value} is outside [{low}, {high}].", param=name, code="invalid_value")
    return float(value)


def _flag(extra: dict[str, Any], name: str) -> bool:
    value = extra.get(name, False)
    if not isinstance(value, bool):
        raise BackendRejected(f"Invalid type for '{name}': expected a boolean.", param=name, code="invalid_type")
    return value


def _budget(extra: dict[str, Any]) -> int | None:
    """``thinking_token_budget`` (vLLM's field; the Messages API's ``thinking.budget_tokens``
    is carried in it): a count of tokens, or None."""
    value = extra.get("thinking_token_budget")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BackendRejected(f"Invalid value for 'thinking_token_budget': expected a count of tokens (>= 0), got {value!r}.",
                              param="thinking_token_budget", code="invalid_value")
    return value


def _unsupported(name: str, why: str) -> BackendRejected:
    return BackendRejected(f"'{name}' is not supported by the in-process engine: {why}.", param=name, code="unsupported_parameter")


def check_unsupported(extra: dict[str, Any]) -> None:
    """400 for a field whose meaning the engine cannot deliver."""
    fmt = extra.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object", "json_schema")):
        raise BackendRejected("Invalid value for 'response_format': its type is 'text', 'json_object' or 'json_schema'.",
                              param="response_format", code="invalid_value")
    if extra.get("echo"):  # completions' own echo is GenerateRequest.echo, not extra
        raise _unsupported("echo", "a chat request does not echo its messages (completions do)")
    best_of = extra.get("best_of")  # (completions' own is GenerateRequest.best_of, not extra)
    if best_of is not None and best_of != 1:
        raise _unsupported("best_of", "a chat request has no best_of (completions do); use n for several choices")
    modalities = extra.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or set(modalities) - {"text"}):
        # (an app asking for spoken answers would otherwise get text with no audio, silently)
        raise _unsupported("modalities", "this engine answers in text only (['text'])")
    if extra.get("audio") is not None:
        raise _unsupported("audio", "this engine answers in text only, it has no audio output")
    sampler = first_unsupported(extra)
    if sampler is not None:
        raise _unsupported(sampler, f"it has no such sampler or constraint (taken only at a value that turns it off, not "
                                    f"{extra[sampler]!r})")


def stop_token_ids(extra: dict[str, Any], vocab_size: int | None) -> tuple[int, ...]:
    """``stop_token_ids`` (vLLM's field): tokens that end the answer as its end of turn does."""
    raw = extra.get("stop_token_ids")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise BackendRejected("Invalid type for 'stop_token_ids': expected a list of token ids.", param="stop_token_ids",
                              code="invalid_type")
    for token in raw:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise BackendRejected(f"Invalid value in 'stop_token_ids': token {token} is outside the vocabulary of "
                                  f"{vocab_size}.", param="stop_token_ids", code="invalid_value")
    return tuple(raw)


# Stop strings are looked for in the text at every token, on the engine's thread: 100,000 of
# them (llama-server's /completion and Ollama's options take a list of any length) cost 30 ms
# per row at every step, every stream slowed with it. OpenAI's API takes 4.
MAX_STOP_STRINGS = 256

# Large maps read, by the identity of the client's map: a request's fields are read twice
# (checked on its worker thread, then for submit on the event loop, where 49,000 entries
# read again held every stream; benchmarks/logit_bias.py); the second reading takes the
# first's. Cleared past 8 maps (a map of 4 MB of JSON is tens of MB in Python).
_READ_BIASES: dict[int, tuple[dict[str, Any], int | None, dict[int, float]]] = {}
_REMEMBERED_BIAS_ENTRIES = 1000  # maps of more entries than this are remembered


def logit_bias(extra: dict[str, Any], vocab_size: int | None) -> dict[int, float]:
    """``logit_bias`` as token id -> bias (ids as JSON object keys are strings)."""
    raw = extra.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BackendRejected("Invalid type for 'logit_bias': expected an object of token ids to numbers.",
                              param="logit_bias", code="invalid_type")
    if len(raw) <= _REMEMBERED_BIAS_ENTRIES:
        return _read_bias(raw, vocab_size)
    read = _READ_BIASES.pop(id(raw), None)  # (the second reading takes it: nothing is held past it)
    if read is not None and read[0] is raw and read[1] == vocab_size:
        return read[2]
    bias = _read_bias(raw, vocab_size)
    if len(_READ_BIASES) >= 8:  # (requests refused or gone between their readings)
        _READ_BIASES.clear()
    _READ_BIASES[id(raw)] = (raw, vocab_size, bias)  # (the map held: its id names it while remembered)
    return bias


def _read_bias(raw: dict[str, Any], vocab_size: int | None) -> dict[int, float]:
    """``logit_bias``'s map read; BackendRejected naming the first entry refused."""
    # The whole map checked at once where it is valid (a whole vocabulary's bias took 26 ms
    # read entry by entry, 11 ms so); the entry-by-entry reading below finds what to name
    # when it is not.
    try:
        tokens = list(map(int, raw))
    except (TypeError, ValueError):
        tokens = None
    values = list(raw.values())
    kinds = set(map(type, values))  # (exactly int or float: a bool is not a number here)
    if tokens and kinds <= {int, float} and min(tokens) >= 0 and (vocab_size is None or max(tokens) < vocab_size) \
            and -LOGIT_BIAS_LIMIT <= min(values) and max(values) <= LOGIT_BIAS_LIMIT:
        return dict(zip(tokens, map(float, values) if int in kinds else values, strict=True))
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BackendRejected(f"Invalid key in 'logit_bias': {key!r} is not a token id.", param="logit_bias",
                                  code="invalid_value") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise BackendRejected(f"Invalid key in 'logit_bias': token {token} is outside the vocabulary of {vocab_size}.",
                                  param="logit_bias", code="invalid_value")
        bias[token] = _number({"logit_bias": value}, "logit_bias", 0.0, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
    return bias


def json_schema(extra: dict[str, Any]) -> dict[str, Any] | None:
    """``response_format``'s JSON schema (OpenAI's ``json_schema.schema``, or llama-server's
    JSON mode held to a schema, ``{"type": "json_object", "schema": ...}``), checked now: 400
    for one the engine cannot constrain its output to (json_schema.py says what it takes)."""
    fmt = extra.get("response_format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_object" and "schema" in fmt:
        schema, where = fmt["schema"], "response_format.schema"
    elif fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema, where = spec.get("schema") if isinstance(spec, dict) else None, "response_format.json_schema.schema"
    else:
        return None
    if not isinstance(schema, dict):
        raise BackendRejected(f"'{where}' must be a JSON schema object.", param="response_format", code="invalid_value")
    return _checked(schema, "response_format", "its JSON schema")


def json_mode(extra: dict[str, Any]) -> bool:
    """JSON mode: ``response_format`` ``json_object`` without a schema (any one object)."""
    fmt = extra.get("response_format")
    return isinstance(fmt, dict) and fmt.get("type") == "json_object" and "schema" not in fmt


def _checked(schema: dict[str, Any], field: str, what: str) -> dict[str, Any]:
    """``schema``, once it compiles; else a 400 naming ``field``."""
    try:
        compile_schema(schema)
    except SchemaError as exc:
        raise _unsupported(field, f"{what} is outside what it can constrain to ({exc})") from None
    return schema


def template_kwargs(extra: dict[str, Any]) -> dict[str, Any] | None:
    """``chat_template_kwargs`` (vLLM's and llama-server's field: arguments for the chat
    template, such as Qwen3's ``enable_thinking``), checked: 400 for what is not an object of
    names, or names the engine sets itself. Ollama's ``think: true|false`` is
    ``enable_thinking``, the templates' name for it."""
    from kvstream.hf.reasoning import RESERVED_TEMPLATE_ARGS

    kwargs = extra.get("chat_template_kwargs")
    think = extra.get("think")  # Ollama's: a thinking model thinks or not
    if kwargs is None:
        return {"enable_thinking": think} if isinstance(think, bool) else None
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise BackendRejected("Invalid type for 'chat_template_kwargs': expected an object of template arguments.",
                              param="chat_template_kwargs", code="invalid_type")
    taken = sorted(RESERVED_TEMPLATE_ARGS.intersection(kwargs))
    if taken:
        raise BackendRejected(f"Invalid value for 'chat_template_kwargs': {taken[0]!r} is set by the server.",
                              param="chat_template_kwargs", code="invalid_value")
    if isinstance(think, bool):
        kwargs = {"enable_thinking": think} | kwargs
    return kwargs


def forces_call(request: GenerateRequest) -> bool:
    """Whether the answer is a tool call (a chat whose ``tool_choice`` forces one)."""
    return request.is_chat and request.extra.get("tool_choice") not in (None, "auto", "none")


def forced_call(extra: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema of the tool call ``tool_choice`` forces (tool_calls.py), checked now;
    None when the model may answer in text."""
    schema = forced_call_schema(holdable_tools(extra.get("tools")), extra.get("tool_choice"))
    if schema is None:
        return None
    if extra.get("response_format") is not None and extra["response_format"].get("type") != "text":
        raise BackendRejected("'tool_choice' forcing a call cannot be combined with a JSON 'response_format'.",
                              param="tool_choice", code="invalid_value")
    return _checked(schema, "tools", "a forced call's parameters")


def referenced_tokens(guided: Guide, vocab_size: int | None, token_of: Callable[[str], int | None] | None,
                      ) -> tuple[tuple[int, str], ...]:
    """A grammar's token references resolved (token id, its character in the pattern): an id
    inside the vocabulary, a text that is one token of it; 400 naming the field otherwise."""
    resolved: list[tuple[int, str]] = []
    for spelling, sentinel in guided.tokens:
        by_id = spelling.startswith("[")  # "[id]", else the token's "<text>"
        token = int(spelling[1:-1]) if by_id else token_of(spelling) if token_of is not None else None
        if token is None:
            raise BackendRejected(f"Invalid value for '{guided.field}': {spelling} is not one token of the model's "
                                  "vocabulary (a token reference names a single token).", param=guided.field,
                                  code="invalid_value")
        if vocab_size is not None and token >= vocab_size:
            raise BackendRejected(f"Invalid value for '{guided.field}': token <{spelling}> is outside the vocabulary "
                                  f"of {vocab_size}.", param=guided.field, code="invalid_value")
        resolved.append((token, sentinel))
    return tuple(resolved)


def _invalid(name: str, why: str) -> BackendRejected:
    return BackendRejected(f"Invalid value for '{name}': {why}.", param=name, code="invalid_value")


def preserved_tokens(extra: dict[str, Any], token_of: Callable[[str], int | None] | None) -> frozenset[int]:
    """llama-server's ``preserved_tokens``: texts whose token, where a text is one, is written
    into the answer even if special (the others are ignored, as llama-server ignores them)."""
    raw = extra.get("preserved_tokens")
    if raw is None:
        return frozenset()
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise _invalid("preserved_tokens", "expected a list of token texts")
    return frozenset(t for t in map(token_of, raw) if t is not None) if token_of is not None else frozenset()


def lazy_triggers(extra: dict[str, Any], vocab_size: int | None, token_of: Callable[[str], int | None] | None,
                  preserved: frozenset[int]) -> Triggers | None:
    """llama-server's ``grammar_lazy`` with its ``grammar_triggers`` (lazy_grammar.py says what
    each type is); None: the grammar holds from the first token (triggers are then read and
    checked, but change nothing, as at llama-server). A word that is one token of the
    vocabulary is that token and must be in ``preserved_tokens`` (llama-server's rule: else
    the token would not be written into the text). 400 naming the field for what it refuses;
    lazy without a trigger too, where llama-server waits for none and holds nothing."""
    lazy = _flag(extra, "grammar_lazy")
    raw = extra.get("grammar_triggers")
    if raw is None or raw == []:
        if lazy:
            raise _invalid("grammar_triggers", "no triggers set for a lazy grammar ('grammar_lazy' is true)")
        return None
    if not isinstance(raw, list):
        raise _invalid("grammar_triggers", "expected a list of {\"type\", \"value\"} objects")
    tokens: set[int] = set()
    words: list[str] = []
    patterns: list[str] = []
    for trigger in raw:
        kind = trigger.get("type") if isinstance(trigger, dict) else None
        value = trigger.get("value") if isinstance(trigger, dict) else None
        if not isinstance(kind, int) or isinstance(kind, bool) or kind not in (TOKEN, WORD, PATTERN, PATTERN_FULL):
            raise _invalid("grammar_triggers", "each trigger's 'type' is 0 (a token), 1 (a word), 2 (a pattern) or "
                                               "3 (a pattern the whole text matches)")
        if not isinstance(value, str):
            raise _invalid("grammar_triggers", "each trigger has a string 'value'")
        if kind == TOKEN:
            token = trigger.get("token")
            if not isinstance(token, int) or isinstance(token, bool) or token < 0 or (
                    vocab_size is not None and token >= vocab_size):
                raise _invalid("grammar_triggers", f"a token trigger's 'token' is a token id of the vocabulary, not "
                                                   f"{token!r}")
            tokens.add(token)
        elif kind == WORD and token_of is not None and (token := token_of(value)) is not None:
            if token not in preserved:
                raise _invalid("grammar_triggers", f"the trigger word {value!r} is one token: it must be listed in "
                                                   "'preserved_tokens' too")
            tokens.add(token)
        elif kind == WORD:
            words.append(value)
        else:
            pattern = value
            if kind == PATTERN_FULL:
                pattern = f"{'' if pattern.startswith('^') else '^'}{pattern}{'' if pattern.endswith('$') else '$'}"
            try:
                compile_trigger(pattern)
            except ValueError as exc:
                raise _invalid("grammar_triggers", str(exc)) from None
            patterns.append(pattern)
    return Triggers(frozenset(tokens), tuple(words), tuple(patterns)) if lazy else None


def sampling_params(request: GenerateRequest, max_tokens: int, vocab_size: int | None = None,
                    generic_calls: bool = False, default_seed: int | None = None,
                    token_of: Callable[[str], int | None] | None = None) -> SamplingParams:
    """The request's SamplingParams; BackendRejected (400, naming the field) for a value the
    engine refuses. ``vocab_size`` None: token ids in ``logit_bias`` are not range-checked.
    ``generic_calls``: its tools are offered the generic way, the answer held to a call or a
    response (generic_calls.py). ``default_seed``: the server's seed for a request that sets
    none (None: a random one). ``token_of``: the id of the one token a text is (a grammar's
    ``<text>`` references; None: they are refused)."""
    extra = request.extra
    check_unsupported(extra)
    if generic_calls:
        answer = _checked(answer_schema(holdable_tools(extra["tools"]), extra.get("parallel_tool_calls") is False), "tools",
                          "the tools' parameters")
    else:
        answer = None
    if max_tokens == 0 and not request.echo:
        raise BackendRejected("Invalid value for 'max_tokens': it must be at least 1 (0 only with echo).",
                              param="max_tokens", code="invalid_value")
    forced = forced_call(extra)
    if forced is not None and not request.is_chat:
        raise BackendRejected("'tool_choice' is a chat completions field.", param="tool_choice", code="invalid_value")
    guided = guide(extra)
    if guided is not None and (forced is not None or answer is not None or json_schema(extra) is not None
                               or (extra.get("response_format") or {}).get("type") == "json_object"):
        raise BackendRejected(f"'{guided.field}' cannot be combined with another hold on the answer (a JSON schema or "
                              "JSON mode, or tools it must call).", param=guided.field, code="invalid_value")
    if guided is not None and guided.schema is not None:
        guided = replace(guided, schema=_checked(guided.schema, guided.field, "its JSON schema"))
    if max_tokens == 0 and max(request.n, request.best_of or 1) > 1:
        field = "n" if request.n > 1 else "best_of"
        raise BackendRejected(f"Invalid value for '{field}': with max_tokens 0 there is one choice, the prompt.",
                              param=field, code="invalid_value")
    if len(request.stop) > MAX_STOP_STRINGS:
        raise BackendRejected(f"Invalid value for 'stop': {len(request.stop)} stop strings, more than the {MAX_STOP_STRINGS} "
                              "this engine takes (each is looked for in the text at every token).", param="stop",
                              code="invalid_value")
    preserved = preserved_tokens(extra, token_of)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            seed=default_seed if request.seed is None else request.seed,
            stop=list(request.stop),
            min_p=_number(extra, "min_p", 0.0, 0.0, 1.0),
            typical_p=_number(extra, "typical_p", 1.0, 0.0, 1.0),
            presence_penalty=_number(extra, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_number(extra, "frequency_penalty", 0.0, -2.0, 2.0),
            repeat_penalty=_number(extra, "repeat_penalty", 1.0, 0.0),
            repeat_last_n=int(_number(extra, "repeat_last_n", 64, -1)),
            logit_bias=logit_bias(extra, vocab_size),
            stop_token_ids=stop_token_ids(extra, vocab_size),
            logprobs=request.logprobs,
            prompt_logprobs=request.logprobs if request.echo else None,
            json_object=json_mode(extra),
            json_schema=forced or answer or json_schema(extra) or (guided.schema if guided is not None else None),
            pattern=guided.pattern if guided is not None else None,
            pattern_tokens=referenced_tokens(guided, vocab_size, token_of) if guided is not None else (),
            # (a lazy hold is the client's own constraint's, never a call KVStream holds)
            triggers=None if forced is not None or answer is not None else lazy_triggers(extra, vocab_size, token_of,
                                                                                         preserved),
            preserved_tokens=preserved,
            thinking_budget=_budget(extra),
            ignore_eos=_flag(extra, "ignore_eos"),
            post_sampling_probs=_flag(extra, "post_sampling_probs"),
        )
    except ValueError as exc:
        raise BackendRejected(str(exc)) from None
