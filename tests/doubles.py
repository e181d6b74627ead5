"""Protocol-faithful doubles of the runtimes that cannot be installed here (Ollama, LM Studio,
Foundry Local) and a scriptable OpenAI-compatible upstream for fault and timing tests.

Their payloads are built from the verbatim examples in tests/fixtures/protocols/ (copied from
shared/protocols/, see its README for sources): same field names, framing, error bodies and
status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from datetime import datetime, timedelta, timezone
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

PROTOCOLS = Path(__file__).parent / "fixtures" / "protocols"


def payload(name: str) -> Any:
    return json.loads((PROTOCOLS / name).read_text())


def ndjson(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (PROTOCOLS / name).read_text().splitlines() if line.strip()]


@dataclass
class Script:
    """What a double does with the next generation requests."""

    tokens: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    delay_s: float = 0.0  # between tokens
    first_delay_s: float = 0.0  # before the first token
    finish_reason: str = "stop"
    die_after: int | None = None  # close the connection after this many tokens
    error_after: int | None = None  # send a runtime error event after this many tokens
    status: int | None = None  # answer with this HTTP error status instead
    error_body: Any = None
    error_html: bool = False  # answer the error status with an HTML page (a reverse proxy's)
    hang: bool = False  # never answer
    malformed_after: int | None = None  # send garbage after this many tokens
    prompt_tokens: int = 7
    usage_in_stream: bool = True
    # Fields a runtime adds that KVStream does not know (llama.cpp's timings, logprobs...):
    # merged into every chunk / the non-streamed body, per-token logprobs into each choice.
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    reasoning: list[str] = field(default_factory=list)  # chat: reasoning_content deltas before the tokens (llama-server's)
    models_hang_after: int | None = None  # /v1/models never answers after this many calls
    load_duration_s: list[float] = field(default_factory=list)  # Ollama: load_duration of the next answers
    expires_in_s: float | None = None  # Ollama: /api/ps lists every model, its lease ending this far ahead


@dataclass
class Recorder:
    """What a double saw: bodies, concurrency, cancellations."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)  # the generation requests' headers (case-insensitive)
    in_flight: int = 0
    max_in_flight: int = 0
    cancelled: int = 0
    completed: int = 0
    models_calls: int = 0
    token_times: list[float] = field(default_factory=list)

    @contextlib.contextmanager
    def tracking(self, body: dict[str, Any]) -> Iterator[None]:
        """Around one request: record its body, concurrency, and whether it was cancelled."""
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


async def _kill_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()  # RST mid-stream, as a crashing runtime does
    raise asyncio.CancelledError


# ----------------------------------------------------------------- OpenAI-compatible
def openai_upstream(script: Script, recorder: Recorder, model_id: str = "test-model") -> web.Application:
    """A scripted OpenAI-compatible server: /v1/models, /v1/chat/completions, /v1/completions."""

    async def models(request: web.Request) -> web.Response:
        recorder.models_calls += 1
        if script.models_hang_after is not None and recorder.models_calls > script.models_hang_after:
            await asyncio.sleep(3600)
        return web.json_response({"object": "list", "data": [{"id": model_id, "object": "model", "created": 1, "owned_by": "double"}]})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("chat/completions")
        recorder.headers.append(request.headers.copy())
        with recorder.tracking(body):
            if script.hang:
                await asyncio.sleep(3600)
            if script.status is not None and script.error_html:
                page = "<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body>" + "<p>nginx</p>" * 200 + "</body></html>"
                return web.Response(text=page, content_type="text/html", status=script.status)
            if script.status is not None:
                return web.json_response(
                    script.error_body or {"error": {"code": script.status, "message": "scripted failure", "type": "server_error"}},
                    status=script.status,
                )
            cid = "chatcmpl-double"
            echoed = body.get("model") or model_id  # like llama-server, the request's name
            usage = {"prompt_tokens": script.prompt_tokens, "completion_tokens": len(script.tokens), "total_tokens": script.prompt_tokens + len(script.tokens)}
            if body.get("stream") is not True:  # a real server answers one JSON body
                if script.first_delay_s:
                    await asyncio.sleep(script.first_delay_s)
                if script.delay_s:
                    await asyncio.sleep(script.delay_s * max(0, len(script.tokens) - 1))
                if script.die_after is not None:
                    await _kill_connection(request)
                if script.error_after is not None:
                    return web.json_response({"error": {"code": 500, "message": "scripted runtime crash", "type": "server_error"}}, status=500)
                if script.malformed_after is not None:
                    return web.Response(body=b"{not json", content_type="application/json")
                text = "".join(script.tokens)
                choice = {"index": 0, "finish_reason": script.finish_reason, "logprobs": _logprobs(script.tokens) if script.logprobs else None}
                message = {"role": "assistant", "content": text} | ({"reasoning_content": "".join(script.reasoning)} if script.reasoning else {})
                choice |= {"message": message} if chat else {"text": text}
                recorder.completed += 1
                return web.json_response(
                    {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": 1, "model": echoed,
                     "choices": [choice], "usage": usage} | script.extra
                )
            options = body.get("stream_options") or {}
            include = options.get("include_usage")  # a bad value fails here, before the stream starts
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            base = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": 1, "model": echoed}
            base |= script.extra

            def frame(obj: dict[str, Any]) -> bytes:
                return b"data: " + json.dumps(obj).encode() + b"\n\n"

            if script.first_delay_s:
                await asyncio.sleep(script.first_delay_s)
            if chat:
                await resp.write(frame(base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
                for thought in script.reasoning:
                    await resp.write(frame(base | {"choices": [{"index": 0, "delta": {"reasoning_content": thought}, "finish_reason": None}]}))
            for i, text in enumerate(script.tokens):
                if script.die_after is not None and i == script.die_after:
                    await _kill_connection(request)
                if script.error_after is not None and i == script.error_after:
                    await resp.write(frame({"error": {"code": 500, "message": "scripted runtime crash", "type": "server_error"}}))
                    return resp
                if script.malformed_after is not None and i == script.malformed_after:
                    await resp.write(b"data: {not json\n\n")
                    return resp
                if i and script.delay_s:
                    await asyncio.sleep(script.delay_s)
                recorder.token_times.append(time.monotonic())
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": None} if chat else {"index": 0, "text": text, "finish_reason": None}
                if script.logprobs:
                    choice["logprobs"] = _logprobs([text])
                await resp.write(frame(base | {"choices": [choice]}))
            final = {"index": 0, "delta": {}, "finish_reason": script.finish_reason} if chat else {"index": 0, "text": "", "finish_reason": script.finish_reason}
            await resp.write(frame(base | {"choices": [final]}))
            if include and script.usage_in_stream:
                await resp.write(frame(base | {"choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            recorder.completed += 1
            return resp

    async def model(request: web.Request) -> web.Response:
        if request.match_info["model"] != model_id:
            return web.json_response({"error": {"code": 404, "message": "model not found", "type": "not_found_error"}}, status=404)
        return web.json_response({"id": model_id, "object": "model", "created": 1, "owned_by": "double"})

    @web.middleware
    async def judge(request: web.Request, handler: Any) -> web.StreamResponse:
        """Like a real runtime: a body it cannot use gets a 400, never a crash."""
        try:
            return await handler(request)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return web.json_response({"error": {"code": 400, "message": f"bad request: {exc}", "type": "invalid_request_error"}}, status=400)

    app = web.Application(middlewares=[judge])
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    return app


def _logprobs(tokens: list[str]) -> dict[str, Any]:
    """OpenAI's logprobs object for these tokens (values made up, shape real)."""
    return {"content": [{"token": t, "logprob": -0.25, "bytes": list(t.encode()), "top_logprobs": []} for t in tokens]}


# ---------------------------------------------------------------------------- Ollama
# Ollama's CORS policy (gin-contrib/cors, server/routes.go): pages of localhost, 127.0.0.1 or
# 0.0.0.0 (any port, http or https) and of app/file/tauri/vscode schemes by default, plus
# OLLAMA_ORIGINS; another origin is answered 403, with no body, preflight or not.
OLLAMA_LOCAL_ORIGIN = re.compile(r"^https?://(localhost|127\.0\.0\.1|0\.0\.0\.0)(:\d+)?$|^(app|file|tauri|vscode-webview|vscode-file)://")


@web.middleware
async def ollama_cors(request: web.Request, handler):
    origin = request.headers.get("Origin")
    if not origin or origin in (f"http://{request.host}", f"https://{request.host}"):
        return await handler(request)
    if not OLLAMA_LOCAL_ORIGIN.match(origin):
        return web.Response(status=403)
    if request.method == "OPTIONS":
        return web.Response(status=204, headers={"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                                                 "Access-Control-Allow-Methods": "GET,POST,PUT,PATCH,DELETE,HEAD,OPTIONS"})
    return await handler(request)


async def ollama_cors_grant(request: web.Request, response: web.StreamResponse) -> None:
    """The grant on an allowed origin's answer (as its head is sent: streamed answers too)."""
    origin = request.headers.get("Origin")
    if origin and OLLAMA_LOCAL_ORIGIN.match(origin) and "Access-Control-Allow-Origin" not in response.headers:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers.add("Vary", "Origin")


def ollama_double(
    script: Script, recorder: Recorder, models: list[str] | None = None, model_info: dict[str, Any] | None = None
) -> web.Application:
    """Ollama's native API: /api/version, /api/tags, /api/ps, /api/chat, /api/generate (NDJSON),
    and /api/show, whose verbose form carries ``model_info`` (a GGUF's metadata) whole."""
    tags = payload("ollama/tags_response.json")
    known = models or [m["name"] for m in tags["models"]]
    chat_template = ndjson("ollama/chat_stream.ndjson")
    gen_template = ndjson("ollama/generate_stream_with_done_reason.ndjson")

    async def version(request: web.Request) -> web.Response:
        return web.json_response(payload("ollama/version_response.json"))

    async def list_tags(request: web.Request) -> web.Response:
        return web.json_response(tags)

    async def ps(request: web.Request) -> web.Response:
        body = payload("ollama/ps_response.json")
        if script.expires_in_s is not None:
            when = datetime.now(timezone.utc) + timedelta(seconds=script.expires_in_s)
            body["models"] = [dict(body["models"][0], name=name, model=name, expires_at=when.isoformat()) for name in known]
        for m in body["models"]:
            m["context_length"] = 4096
        return web.json_response(body)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path == "/api/chat"
        if not chat and "prompt" not in body:  # load the model (or renew its keep_alive) only
            recorder.bodies.append(body)
            return web.json_response(dict(payload("ollama/generate_load_response.json"), model=body.get("model")))
        with recorder.tracking(body):
            if body.get("model") not in known:
                return web.json_response({"error": f'model "{body.get("model")}" not found, try pulling it first'}, status=404)
            if script.status == 503:
                return web.json_response(payload("ollama/error_queue_full_503.json"), status=503)
            if script.status is not None and script.error_html:
                return web.Response(text="<html><body><h1>502 Bad Gateway</h1></body></html>", content_type="text/html", status=script.status)
            if script.status is not None:
                return web.json_response(payload("ollama/error_response.json"), status=script.status)
            if body.get("stream") is False:  # one object, as Ollama answers stream: false
                final = dict(chat_template[-1] if chat else gen_template[-1])
                text = "".join(script.tokens)
                final.update(model=body["model"], done=True, done_reason="length" if script.finish_reason == "length" else "stop",
                             prompt_eval_count=script.prompt_tokens, eval_count=len(script.tokens))
                final.update({"message": {"role": "assistant", "content": text}} if chat else {"response": text})
                recorder.completed += 1
                return web.json_response(final)
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            template = chat_template[0] if chat else gen_template[0]
            for i, text in enumerate(script.tokens):
                if script.error_after is not None and i == script.error_after:
                    await resp.write(json.dumps(ndjson("ollama/stream_error.ndjson")[-1]).encode() + b"\n")
                    return resp
                if script.die_after is not None and i == script.die_after:
                    return resp  # EOF without done:true
                if script.malformed_after is not None and i == script.malformed_after:
                    await resp.write(b'{"model": "x", "message": {\n')
                    return resp
                if i and script.delay_s:
                    await asyncio.sleep(script.delay_s)
                obj = dict(template, model=body["model"])
                if chat:
                    obj["message"] = {"role": "assistant", "content": text}
                else:
                    obj["response"] = text
                if body.get("logprobs"):  # the ollama client's Logprob: token, logprob, top_logprobs
                    top = [{"token": f"{text}~{k}", "logprob": -1.0 - k} for k in range(body.get("top_logprobs") or 0)]
                    obj["logprobs"] = [{"token": text, "logprob": -0.25 * (i + 1), "top_logprobs": top}]
                await resp.write(json.dumps(obj).encode() + b"\n")
            final = dict(chat_template[-1] if chat else gen_template[-1])
            final.update(model=body["model"], done=True, done_reason="length" if script.finish_reason == "length" else "stop")
            if chat:
                final["message"] = {"role": "assistant", "content": ""}
            else:
                final["response"] = ""
            final.update(prompt_eval_count=script.prompt_tokens, eval_count=len(script.tokens), total_duration=4883583458, eval_duration=4535599000)
            if script.load_duration_s:
                final["load_duration"] = int(script.load_duration_s.pop(0) * 1e9)
            await resp.write(json.dumps(final).encode() + b"\n")
            recorder.completed += 1
            return resp

    app = web.Application(middlewares=[ollama_cors])
    app.on_response_prepare.append(ollama_cors_grant)
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", list_tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/chat", generate)
    app.router.add_post("/api/generate", generate)

    async def show(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("model") not in known:
            return web.json_response({"error": f'model "{body.get("model")}" not found'}, status=404)
        info = dict(model_info or {"general.architecture": "llama"})
        if not body.get("verbose"):  # Ollama leaves the large arrays out unless asked
            info = {k: (None if isinstance(v, list) else v) for k, v in info.items()}
        return web.json_response({"modelfile": "", "template": "{{ .Prompt }}", "details": {"format": "gguf"}, "model_info": info})

    app.router.add_post("/api/show", show)
    return app


# ------------------------------------------------------------------------- LM Studio
def lmstudio_double(script: Script, recorder: Recorder, loaded: bool = True) -> web.Application:
    """LM Studio: OpenAI routes, /api/v0/models, the no-models-loaded error, 200 on unknown routes."""
    models = payload("lmstudio/api_v0_models_response.json")
    if loaded:
        models["data"][1]["state"] = "loaded"
    model_id = models["data"][1]["id"]
    inner = openai_upstream(script, recorder, model_id)

    async def v0_models(request: web.Request) -> web.Response:
        return web.json_response(models)

    async def v1_models(request: web.Request) -> web.Response:
        data = [{"id": m["id"], "object": "model", "owned_by": m["publisher"]} for m in models["data"]]
        return web.json_response({"object": "list", "data": data})

    async def chat(request: web.Request) -> web.StreamResponse:
        if not loaded:
            return web.json_response(payload("lmstudio/error_no_models_loaded.json"), status=404)
        return await _delegate(inner, request)

    async def unknown(request: web.Request) -> web.Response:
        # LM Studio answers unknown routes with 200 (lmstudio-bug-tracker#1879).
        return web.json_response({"error": f"Unexpected endpoint or method. ({request.method} {request.path}). Returning 200 anyway"})

    app = web.Application()
    app.router.add_get("/api/v0/models", v0_models)
    app.router.add_get("/v1/models", v1_models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", chat)
    app.router.add_route("*", "/{tail:.*}", unknown)
    return app


async def _delegate(inner: web.Application, request: web.Request) -> web.StreamResponse:
    match = await inner.router.resolve(request)
    return await match.handler(request)


# --------------------------------------------------------------------- Foundry Local
def foundry_double(script: Script, recorder: Recorder) -> web.Application:
    """Foundry Local as a fresh service finds it: /openai/status, the /foundry/list catalog
    (GPU and CPU variants of one alias), /openai/models (what this machine downloaded: the
    CPU variant), nothing loaded (/openai/loadedmodels, and /v1/models's envelope lists only
    loaded models), /openai/load/{id} (refused for a model not downloaded), and a chat that
    refuses a model it has not loaded and knows model ids, not aliases."""
    model_id = "Phi-4-mini-instruct-generic-cpu"
    inner = openai_upstream(script, recorder, model_id)
    catalog = [
        {"name": "Phi-4-mini-instruct-generic-gpu", "alias": "phi-4-mini", "runtime": {"deviceType": "GPU", "executionProvider": "CUDAExecutionProvider"}},
        {"name": model_id, "alias": "phi-4-mini", "runtime": {"deviceType": "CPU", "executionProvider": "CPUExecutionProvider"}},
    ]
    downloaded = payload("foundry/openai_models_response.json")
    loaded: list[str] = []

    def not_found(name: object) -> web.Response:
        return web.json_response(
            {"error": {"message": f"No OpenAIService provider found for modelName {name}", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}},
            status=400,
        )

    async def status(request: web.Request) -> web.Response:
        body = payload("foundry/openai_status_response.json")
        body["Endpoints"] = [f"http://127.0.0.1:{request.url.port}"]
        return web.json_response(body)

    async def foundry_list(request: web.Request) -> web.Response:
        return web.json_response(catalog)

    async def openai_models(request: web.Request) -> web.Response:
        return web.json_response(downloaded)

    async def loaded_models(request: web.Request) -> web.Response:
        return web.json_response(loaded)

    async def load(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in downloaded:
            return not_found(name)
        recorder.bodies.append({"load": name, "query": dict(request.query)})
        if name not in loaded:
            loaded.append(name)
        return web.json_response({})

    async def v1_models(request: web.Request) -> web.Response:
        body = payload("foundry/v1_models_response_empty.json")
        body["data"] = [{"id": name, "object": "model", "owned_by": "Microsoft"} for name in loaded]
        return web.json_response(body)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("model") not in loaded:
            return not_found(body.get("model"))
        return await _delegate(inner, request)

    app = web.Application()
    app.router.add_get("/openai/status", status)
    app.router.add_get("/foundry/list", foundry_list)
    app.router.add_get("/openai/models", openai_models)
    app.router.add_get("/openai/loadedmodels", loaded_models)
    app.router.add_get("/openai/load/{name}", load)
    app.router.add_get("/v1/models", v1_models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


# ------------------------------------------------------------ vLLM / SGLang (metered)
METRICS = Path(__file__).parent / "fixtures" / "metrics"
# The samples of each engine's scrape that carry running, waiting and KV usage.
ENGINE_GAUGES = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
}


@dataclass
class EngineLoad:
    """What a metered double's /metrics says: its own requests in flight plus
    ``others_running`` (other clients'), ``waiting`` queued, ``kv_usage``."""

    engine: str = "vllm"
    others_running: int = 0
    waiting: int = 0
    kv_usage: float = 0.05
    garbage: bool = False  # /metrics answers an HTML page instead
    scrapes: int = 0


def set_sample(text: str, name: str, value: float) -> str:
    """``text`` with every series of sample ``name`` set to ``value``."""
    import re

    pattern = re.compile(rf"^({re.escape(name)}(?:\{{[^}}]*\}})?) \S+$", re.MULTILINE)
    return pattern.sub(lambda m: f"{m.group(1)} {float(value)!r}", text)


def metered_upstream(script: Script, recorder: Recorder, load: EngineLoad | None = None, model_id: str = "test-model") -> web.Application:
    """An OpenAI-compatible double that also serves vLLM's or SGLang's /metrics (the
    fixture scrape, its load gauges rewritten from ``load`` and the requests in flight)."""
    load = load or EngineLoad()
    app = openai_upstream(script, recorder, model_id)

    async def metrics(request: web.Request) -> web.Response:
        load.scrapes += 1
        if load.garbage:
            return web.Response(text="<html><body>metrics are off</body></html>", content_type="text/html")
        text = (METRICS / f"{load.engine}.prom").read_text()
        running, waiting, usage = ENGINE_GAUGES[load.engine]
        text = set_sample(text, running, recorder.in_flight + load.others_running)
        text = set_sample(text, waiting, load.waiting)
        text = set_sample(text, usage, load.kv_usage)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    app.router.add_get("/metrics", metrics)
    return app
