"""llama-server's own routes (``/completion``, ``/tokenize``, ``/detokenize``) answered by
the in-process engine as llama-server answers them: a client written for llama-server works
with the embedded model. The text is plain transformers' greedy text on the same ids; the
shapes are llama-server's (``../shared/protocols/llamacpp``, its server tests' assertions)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.conftest import require_import

torch = require_import("torch")

PROMPT = "I believe the meaning of life is"


def reference(smollm2, ids: list[int], tokens: int) -> list[int]:
    """Plain transformers' greedy continuation of ``ids``."""
    _, model, tokenizer = smollm2
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0][len(ids):].tolist()


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, object]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


async def events(session: aiohttp.ClientSession, url: str, body: dict) -> list[dict]:
    """A llama-server stream's events: ``data:`` lines, and no ``[DONE]`` after the last."""
    async with session.post(url, json=body) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        text = (await response.read()).decode()
    lines = [line for line in text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines) and "[DONE]" not in text
    return [json.loads(line.removeprefix("data: ")) for line in lines]


async def test_tokenize_and_detokenize_are_the_models_tokenizer(hf_proxy, smollm2):
    tokenizer = smollm2[2]
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, hf_proxy.url + "/tokenize", {"content": PROMPT})
        assert status == 200 and body == {"tokens": tokenizer(PROMPT, add_special_tokens=False).input_ids}
        status, back = await post(session, hf_proxy.url + "/detokenize", {"tokens": body["tokens"]})
        assert status == 200 and back == {"content": PROMPT}

        # Special tokens' spellings are those tokens unless parse_special is false.
        special = "<|im_start|>user"
        _, parsed = await post(session, hf_proxy.url + "/tokenize", {"content": special})
        _, spelled = await post(session, hf_proxy.url + "/tokenize", {"content": special, "parse_special": False})
        assert parsed["tokens"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert len(spelled["tokens"]) > len(parsed["tokens"])

        # Pieces: text where a token is whole UTF-8, its bytes where it holds part of a character.
        text = "unicode 媽 and emoji 🤗"
        _, pieces = await post(session, hf_proxy.url + "/tokenize", {"content": text, "with_pieces": True})
        raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces["tokens"])
        assert raw.decode() == text
        assert any(isinstance(p["piece"], list) for p in pieces["tokens"]) and all(p["id"] >= 0 for p in pieces["tokens"])

        status, error = await post(session, hf_proxy.url + "/detokenize", {"tokens": [10 ** 9]})
        assert status == 400 and error["error"]["code"] == 400 and "vocabulary" in error["error"]["message"]
        status, error = await post(session, hf_proxy.url + "/tokenize", {"content": 5})
        assert status == 400 and error["error"]["type"] == "invalid_request_error"


async def test_a_completion_is_greedy_transformers_in_llama_servers_shape(hf_proxy, smollm2):
    tokenizer = smollm2[2]
    ids = tokenizer(PROMPT).input_ids
    expected = reference(smollm2, ids, 8)
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, hf_proxy.url + "/completion",
                                  {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "return_tokens": True})
        assert status == 200
        assert body["tokens"] == expected and body["content"] == tokenizer.decode(expected)
        assert body["stop"] is True and body["stop_type"] == "limit" and body["truncated"] is False
        assert body["tokens_predicted"] == 8 and body["tokens_evaluated"] == len(ids)
        timings = body["timings"]
        assert timings["predicted_n"] == 8
        # The rate is over the 7 steps after the first token (which came with the prompt).
        assert timings["predicted_per_second"] == pytest.approx(1000 / timings["predicted_ms"] * 7)
        assert timings["predicted_per_token_ms"] == pytest.approx(timings["predicted_ms"] / 7)
        _, single = await post(session, hf_proxy.url + "/completion", {"prompt": PROMPT, "n_predict": 1})
        assert single["timings"]["predicted_per_second"] == single["timings"]["predicted_per_token_ms"] == 0.0
        assert body["timings"]["prompt_n"] + body["timings"]["cache_n"] == len(ids)
        assert body["prompt"] == PROMPT and isinstance(body["has_new_line"], bool)
        settings = body["generation_settings"]
        assert settings["n_predict"] == 8 and settings["temperature"] == 0 and settings["top_k"] == 40
        assert settings["seed"] == 0xFFFFFFFF  # llama-server's "random"

        # Streamed: the same text a token at a time, then the final object without it.
        streamed = await events(session, hf_proxy.url + "/completion",
                                {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "stream": True})
        *partials, final = streamed
        assert all(p["stop"] is False and len(p["tokens"]) == 1 for p in partials)
        assert [p["tokens"][0] for p in partials] == expected
        assert "".join(p["content"] for p in partials) == body["content"]
        assert final["stop"] is True and final["content"] == "" and final["stop_type"] == "limit"
        assert final["timings"]["cache_n"] > 0  # the prompt was cached by the first request

        # Token ids, a mix of ids and text, and {"prompt_string"} are the same prompt.
        half = len(PROMPT) // 2
        split = PROMPT.rfind(" ", 0, half)
        for prompt in (ids, {"prompt_string": PROMPT}, tokenizer(PROMPT[:split]).input_ids + [PROMPT[split:]]):
            _, again = await post(session, hf_proxy.url + "/completion",
                                  {"prompt": prompt, "n_predict": 8, "temperature": 0, "return_tokens": True})
            assert again["tokens"] == expected, prompt

        # A list of prompts is a batch: a list of answers, in order.
        status, batch = await post(session, hf_proxy.url + "/completion",
                                   {"prompt": [ids, "The capital of France is"], "n_predict": 4, "temperature": 0,
                                    "return_tokens": True})
        assert status == 200 and [answer["index"] for answer in batch] == [0, 1]
        assert batch[0]["tokens"] == expected[:4]
        assert batch[1]["tokens"] == reference(smollm2, tokenizer("The capital of France is").input_ids, 4)

        # response_fields keeps only what it names, a nested field by its path.
        _, picked = await post(session, hf_proxy.url + "/completion",
                               {"prompt": PROMPT, "n_predict": 2, "response_fields": ["content", "generation_settings/n_predict"]})
        assert set(picked) == {"content", "generation_settings/n_predict"} and picked["generation_settings/n_predict"] == 2


async def test_stops_probabilities_bias_and_prefill_only(hf_proxy, smollm2):
    tokenizer = smollm2[2]
    ids = tokenizer(PROMPT).input_ids
    expected = tokenizer.decode(reference(smollm2, ids, 8))
    word = expected.split()[2]
    async with aiohttp.ClientSession() as session:
        _, stopped = await post(session, hf_proxy.url + "/completion",
                                {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "stop": [word]})
        assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
        assert stopped["content"] == expected[: expected.index(word)]

        # n_probs: each token's log-probability and its alternatives, with ids (and the
        # OpenAI route's numbers for the same tokens).
        _, probed = await post(session, hf_proxy.url + "/completion",
                               {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "n_probs": 5, "return_tokens": True})
        probabilities = probed["completion_probabilities"]
        assert [p["id"] for p in probabilities] == probed["tokens"]
        for entry in probabilities:
            assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 5
            assert entry["top_logprobs"][0]["id"] == entry["id"]  # greedy: the most likely
            assert all(isinstance(alt["id"], int) and alt["bytes"] for alt in entry["top_logprobs"])
        _, openai_body = await post(session, hf_proxy.v1 + "/completions",
                                    {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1})
        assert [p["logprob"] for p in probabilities] == pytest.approx(openai_body["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)

        # logit_bias in llama-server's list form pushes the end of text first; ignore_eos
        # then generates on to n_predict.
        eos = tokenizer.eos_token_id
        _, ended = await post(session, hf_proxy.url + "/completion",
                              {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "logit_bias": [[eos, 100]]})
        assert ended["stop_type"] == "eos" and ended["content"] == "" and ended["tokens_predicted"] == 0
        _, kept_on = await post(session, hf_proxy.url + "/completion",
                                {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "logit_bias": [[eos, 100], [5, 1.5]],
                                 "ignore_eos": True, "return_tokens": True})
        assert kept_on["stop_type"] == "limit" and kept_on["tokens_predicted"] == 6
        # llama-server's ignore_eos: the end tokens are banned (never drawn, even pushed
        # first), and listed in the settings' logit_bias as bans (null: its -inf).
        ends = hf_proxy.engine.backend.end_token_ids()
        assert eos in ends and not set(kept_on["tokens"]) & set(ends)
        reported = kept_on["generation_settings"]["logit_bias"]
        assert {"bias": 1.5, "token": 5} in reported
        assert [entry["token"] for entry in reported if entry["bias"] is None] == list(ends)
        _, banned = await post(session, hf_proxy.url + "/completion",
                               {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "return_tokens": True,
                                "logit_bias": [[probed["tokens"][0], False]]})
        assert banned["tokens"][0] != probed["tokens"][0]
        # A text biases each of its tokens, in the list form and as an object's key; an
        # object's number keys are ids (OpenAI's form).
        first_text = tokenizer.decode(probed["tokens"][:1])
        _, by_text = await post(session, hf_proxy.url + "/completion",
                                {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "return_tokens": True,
                                 "logit_bias": [[first_text, -100]]})
        _, by_key = await post(session, hf_proxy.url + "/completion",
                               {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "return_tokens": True,
                                "logit_bias": {str(probed["tokens"][0]): -100}})
        _, by_text_key = await post(session, hf_proxy.url + "/completion",
                                    {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "return_tokens": True,
                                     "logit_bias": {first_text: -100}})
        assert by_text["tokens"] == by_key["tokens"] == by_text_key["tokens"] == banned["tokens"][:1]

        # n_predict 0: the prompt computed into the cache, nothing generated.
        fresh = "A prompt that only fills the cache, " * 6
        _, prefilled = await post(session, hf_proxy.url + "/completion", {"prompt": fresh, "n_predict": 0})
        assert prefilled["content"] == "" and prefilled["tokens_predicted"] == 0 and prefilled["stop_type"] == "limit"
        _, after = await post(session, hf_proxy.url + "/completion", {"prompt": fresh, "n_predict": 1})
        assert after["timings"]["cache_n"] >= 32


async def test_post_sampling_probs_are_the_distribution_drawn_from(hf_proxy, smollm2):
    """``post_sampling_probs`` (llama-server's): ``n_probs`` gives each token's probability
    under the distribution it was drawn from, after temperature and top-k (here: the
    model's top 5 at temperature 0.7, renormalized), only tokens it could have drawn; greedy,
    the chosen token, certain. Without it the model's own log-probabilities, as before. On
    the OpenAI route the same field gives the same numbers as logprobs."""
    import math

    import openai

    _, model, tokenizer = smollm2
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 5)
    drawn = dict(zip(top.indices.tolist(), torch.softmax(top.values / 0.7, -1).tolist(), strict=True))
    sampled = {"prompt": PROMPT, "n_predict": 1, "temperature": 0.7, "top_k": 5, "top_p": 1.0, "min_p": 0.0,
               "n_probs": 10, "post_sampling_probs": True, "return_tokens": True, "seed": 3}
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, hf_proxy.url + "/completion", sampled)
        assert status == 200, body
        [entry] = body["completion_probabilities"]
        assert "logprob" not in entry and "top_logprobs" not in entry
        assert entry["id"] == body["tokens"][0] and entry["prob"] == pytest.approx(drawn[entry["id"]], abs=1e-4)
        assert [alt["id"] for alt in entry["top_probs"]] == list(drawn)  # 5 of the 10 asked: only those it could draw
        assert [alt["prob"] for alt in entry["top_probs"]] == pytest.approx(list(drawn.values()), abs=1e-4)
        assert all(alt["bytes"] and isinstance(alt["token"], str) for alt in entry["top_probs"])
        assert body["generation_settings"]["post_sampling_probs"] is True

        _, greedy = await post(session, hf_proxy.url + "/completion", sampled | {"temperature": 0, "n_predict": 3})
        for entry in greedy["completion_probabilities"]:
            assert entry["prob"] == 1.0 and entry["top_probs"] == [{k: entry[k] for k in ("id", "token", "prob", "bytes")}]
        streamed = await events(session, hf_proxy.url + "/completion", sampled | {"stream": True})
        assert streamed[0]["completion_probabilities"][0]["id"] == body["tokens"][0]  # the same seed, the same draw
        assert streamed[0]["completion_probabilities"][0]["prob"] == pytest.approx(entry_prob := drawn[body["tokens"][0]], abs=1e-4)

        _, model_own = await post(session, hf_proxy.url + "/completion", sampled | {"post_sampling_probs": False})
        [own] = model_own["completion_probabilities"]
        assert len(own["top_logprobs"]) == 10 and "prob" not in own
        assert own["logprob"] == pytest.approx(torch.log_softmax(logits, -1)[own["id"]].item(), abs=1e-4)

    async with openai.AsyncOpenAI(base_url=hf_proxy.v1, api_key="unused", max_retries=0) as client:
        reply = await client.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0.7, seed=3, logprobs=5,
            extra_body={"top_k": 5, "post_sampling_probs": True})
        logprobs = reply.choices[0].logprobs
        assert math.exp(logprobs.token_logprobs[0]) == pytest.approx(entry_prob, abs=1e-4)
        assert {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t)[0]) for t in logprobs.top_logprobs[0]} == set(drawn)
        assert sum(math.exp(v) for v in logprobs.top_logprobs[0].values()) == pytest.approx(1.0, abs=1e-4)


async def test_post_sampling_probs_under_a_grammar_are_the_distribution_it_allows(hf_proxy, smollm2):
    """With a grammar, a sampled token is drawn from the filtered distribution restricted to
    what the grammar accepts (as llama-server samples): ``prob`` and ``top_probs`` are that
    distribution, renormalized, only tokens it accepts; greedy: the chosen token, certain.
    Without a top_k to bound the tokens judged, a 400."""
    import regex

    _, model, tokenizer = smollm2
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 5)
    texts = [tokenizer.decode([t]) for t in top.indices.tolist()]
    allowed = f"(?:{regex.escape(texts[1])}|{regex.escape(texts[3])})[a-z ]*"  # the 2nd and 4th most likely first
    grammar = f'root ::= ({json.dumps(texts[1])} | {json.dumps(texts[3])}) [a-z ]*'
    weights = {t: w for t, w, text in zip(top.indices.tolist(), torch.softmax(top.values / 0.7, -1).tolist(), texts, strict=True)
               if regex.fullmatch(allowed, text, partial=True)}
    expected = {t: w / sum(weights.values()) for t, w in weights.items()}
    assert len(expected) >= 2
    body = {"prompt": PROMPT, "n_predict": 1, "temperature": 0.7, "top_k": 5, "top_p": 1.0, "min_p": 0.0, "n_probs": 10,
            "post_sampling_probs": True, "return_tokens": True, "seed": 3, "grammar": grammar}
    async with aiohttp.ClientSession() as session:
        status, answer = await post(session, hf_proxy.url + "/completion", body)
        assert status == 200, answer
        [entry] = answer["completion_probabilities"]
        assert entry["id"] in expected and entry["prob"] == pytest.approx(expected[entry["id"]], abs=1e-4)
        assert {alt["id"]: alt["prob"] for alt in entry["top_probs"]} == pytest.approx(expected, abs=1e-4)
        _, greedy = await post(session, hf_proxy.url + "/completion", body | {"temperature": 0, "n_predict": 2})
        assert all(e["prob"] == 1.0 for e in greedy["completion_probabilities"])
        assert greedy["tokens"][0] == top.indices.tolist()[1]  # the most likely the grammar accepts
        status, refused = await post(session, hf_proxy.url + "/completion", body | {"top_k": 0})
        assert status == 400 and "top_k" in refused["error"]["message"]


@pytest.mark.parametrize("body,param", [
    ({"n_predict": 4}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], 7]}, "prompt"),
    ({"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": "x", "mirostat": 2}, "mirostat"),
    ({"prompt": "x", "grammar": "root ::= a"}, "grammar"),  # an undefined rule
    ({"prompt": "x", "grammar": "root ::= \"a\"", "grammar_lazy": True}, "grammar_triggers"),  # no trigger
    ({"prompt": "x", "grammar": "root ::= \"a\"", "grammar_lazy": True, "grammar_triggers": [{"type": 9}]}, "grammar_triggers"),
    ({"prompt": "x", "preserved_tokens": "<|im_end|>"}, "preserved_tokens"),
    ({"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {"type": "object"}}, "grammar"),
    ({"prompt": "x", "n_probs": 50}, "n_probs"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),  # (Python's json writes NaN; was read as greedy)
    ({"prompt": "x", "logit_bias": [[5, float("nan")]]}, "logit_bias"),  # (was a bias of 100)
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "logit_bias": [[1]]}, "logit_bias"),
    ({"prompt": "x", "n_predict": -5}, "n_predict"),
    ({"prompt": ["a", "b"], "stream": True}, "stream"),
    ({"prompt": ["a"] * 129}, "prompt"),
    ({"prompt": "x", "xtc_probability": 0.5}, "xtc_probability"),
    ({"prompt": "x", "top_n_sigma": 1.5}, "top_n_sigma"),
    ({"prompt": "x", "dry_multiplier": "on"}, "dry_multiplier"),
    ({"prompt": "x", "post_sampling_probs": "yes"}, "post_sampling_probs"),
    ({"prompt": "x", "n_probs": 2, "post_sampling_probs": True, "top_k": 0, "json_schema": {"type": "object"}},
     "post_sampling_probs"),
    ({"prompt": "x", "n_predict": 100000}, None),
    ({"prompt": "x", "json_schema": {"type": "object", "patternProperties": {"a": {}}}}, "json_schema"),
])
async def test_bad_completions_are_400s_in_llama_servers_shape(hf_proxy, body, param):
    """Every refusal names what is wrong, and the neutral values of samplers the engine
    lacks (what llama.cpp's web UI sends with every request) are taken."""
    async with aiohttp.ClientSession() as session:
        status, error = await post(session, hf_proxy.url + "/completion", body)
        assert status == 400, error
        assert set(error) == {"error"} and set(error["error"]) == {"code", "message", "type"}
        assert error["error"]["code"] == 400 and error["error"]["type"] == "invalid_request_error"
        if param is not None:
            assert param in error["error"]["message"] or param == "prompt"
            assert "response_format" not in error["error"]["message"]
        status, fine = await post(session, hf_proxy.url + "/completion", {
            "prompt": "x", "n_predict": 1, "mirostat": 0, "dry_multiplier": 0, "xtc_probability": 0, "top_n_sigma": -1,
            "grammar": "", "grammar_lazy": False, "cache_prompt": True, "id_slot": -1, "samplers": ["top_k", "temperature"],
            "dynatemp_range": 0, "xtc_threshold": 0.1, "lora": [], "post_sampling_probs": False})
        assert status == 200 and fine["tokens_predicted"] == 1


async def test_a_client_leaving_a_stream_or_a_batch_frees_what_it_held(hf_proxy):
    """A stream the client drops mid-way, and a batch whose request is cut off, are
    cancelled and every block is released; a batch with one bad prompt is refused whole."""
    import asyncio

    from tests.conftest import wait_released

    async with aiohttp.ClientSession() as session:
        response = await session.post(hf_proxy.url + "/completion",
                                      json={"prompt": PROMPT, "n_predict": 2000, "ignore_eos": True, "stream": True})
        assert (await response.content.readline()).startswith(b"data: ")
        response.close()
    await wait_released(hf_proxy)
    assert not hf_proxy.engine._generations

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
        with pytest.raises(asyncio.TimeoutError):
            await post(session, hf_proxy.url + "/completion",
                       {"prompt": [PROMPT, PROMPT + " indeed"], "n_predict": 2000, "ignore_eos": True})
    await wait_released(hf_proxy)
    assert not hf_proxy.engine._generations

    async with aiohttp.ClientSession() as session:
        status, error = await post(session, hf_proxy.url + "/completion", {"prompt": [PROMPT, [10 ** 9]], "n_predict": 4})
        assert status == 400 and "vocabulary" in error["error"]["message"]
    await wait_released(hf_proxy)
    assert not hf_proxy.engine._generations


@pytest.mark.parametrize("failing_step", [1, 4], ids=["before the first token", "mid-stream"])
async def test_the_engine_failing_ends_the_answer_with_llama_servers_error(hf_proxy, monkeypatch, failing_step):
    """Before anything is sent, the failure is the HTTP error (500, llama-server's shape);
    mid-stream, the tokens sent stay sent and a ``data:`` event holding the error ends the
    stream, as newer llama-servers do. Either way everything is released and the next
    request is served."""
    from tests.conftest import fail_forward_at, wait_released

    fail_forward_at(monkeypatch, failing_step)
    body = {"prompt": "1, 2, 3, 4,", "n_predict": 40, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(hf_proxy.url + "/completion", json=body) as response:
            if failing_step == 1:
                error = await response.json()
                assert response.status == 500 and set(error["error"]) == {"code", "message", "type"}
                assert error["error"]["code"] == 500
            else:
                assert response.status == 200
                lines = [line for line in (await response.read()).decode().split("\n") if line]
                sent = [json.loads(line.removeprefix("data: ")) for line in lines]
                assert sent[0]["stop"] is False and sent[0]["content"]  # tokens before the failure
                assert set(sent[-1]) == {"error"} and sent[-1]["error"]["code"] == 500
                assert not any(event.get("stop") is True for event in sent)  # no fake finish
        await wait_released(hf_proxy)
        assert not hf_proxy.engine._generations
        status, after = await post(session, hf_proxy.url + "/completion", {"prompt": "1, 2, 3, 4,", "n_predict": 2})
        assert status == 200 and after["stop_type"] == "limit"


async def test_props_slots_and_apply_template_are_llama_servers(hf_proxy, smollm2):
    """What clients of llama-server read before they generate (its web UI, editor plugins):
    ``/props``, ``/slots`` and ``/apply-template``, of the in-process engine."""
    import asyncio

    from tests.conftest import wait_released

    tokenizer = smollm2[2]
    limits = await hf_proxy.engine.backend.limits()
    async with aiohttp.ClientSession() as session:
        async with session.get(hf_proxy.url + "/props") as response:
            props = await response.json()
        assert response.status == 200
        assert props["default_generation_settings"]["n_ctx"] == limits.n_ctx_per_request == 8192
        assert props["total_slots"] == limits.parallel == 16 and props["is_sleeping"] is False
        assert props["chat_template"] == tokenizer.chat_template and props["modalities"]["vision"] is False
        # The defaults it reports are those a body that sets nothing gets.
        _, done = await post(session, hf_proxy.url + "/completion", {"prompt": PROMPT, "n_predict": 1})
        params = props["default_generation_settings"]["params"]
        for name, value in done["generation_settings"].items():
            if name in params and name != "n_predict":
                assert params[name] == value, name

        messages = [{"role": "user", "content": "What is today?"}]
        # A chat's prompt counted (llama-server's /v1/chat/completions/input_tokens), exactly.
        for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
            async with session.post(hf_proxy.url + path, json={"messages": messages}) as response:
                counted = await response.json()
            expected_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            expected_ids = expected_ids["input_ids"] if hasattr(expected_ids, "get") else expected_ids
            assert counted == {"input_tokens": len(expected_ids), "object": "response.input_tokens"}
            assert response.headers["X-KVStream-Tokens"] == "exact"
        status, error = await post(session, hf_proxy.url + "/v1/chat/completions/input_tokens", {"messages": "x"})
        assert status == 400 and error["error"]["param"] == "messages"
        for generation_prompt in (True, False):
            status, templated = await post(session, hf_proxy.url + "/apply-template",
                                           {"messages": messages, "add_generation_prompt": generation_prompt})
            expected = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            assert status == 200 and templated == {"prompt": expected}
        for body in ({}, {"messages": "x"}, {"messages": messages, "add_generation_prompt": "yes"}):
            status, error = await post(session, hf_proxy.url + "/apply-template", body)
            assert status == 400 and error["error"]["type"] == "invalid_request_error", error

        # SmolLM2 has no fill-in-the-middle tokens: llama-server's 501, word for word, whatever the body.
        for body in ({"input_prefix": "def f(", "input_suffix": ")\n"}, {"input_extra": "x"}):
            status, error = await post(session, hf_proxy.url + "/infill", body)
            assert status == 501 and error == {"error": {
                "code": 501, "type": "not_supported_error", "message": "Infill is not supported by this model: prefix "
                "token is missing. suffix token is missing. middle token is missing. "}}

        # While the model loads: llama-server's 503.
        loaded_limits = hf_proxy.engine.backend.limits

        async def loading():
            from kvstream.types import RuntimeLimits
            return RuntimeLimits()

        hf_proxy.engine.backend.limits = loading
        try:
            for path in ("/props", "/slots"):
                async with session.get(hf_proxy.url + path) as response:
                    assert response.status == 503 and (await response.json())["error"] == {
                        "code": 503, "message": "Loading model", "type": "unavailable_error"}
        finally:
            hf_proxy.engine.backend.limits = loaded_limits

        status, error = await post(session, hf_proxy.url + "/slots/0?action=save", {"filename": "x.bin"})
        assert status == 501 and error["error"]["type"] == "not_supported_error"

        # Slots are the engine's batch lanes: busy while generating; with all busy,
        # fail_on_no_slot is llama-server's 503.
        async with session.get(hf_proxy.url + "/slots?fail_on_no_slot=1") as response:
            idle = await response.json()
        assert response.status == 200 and len(idle) == 16 and not any(slot["is_processing"] for slot in idle)
        streams = await asyncio.gather(*(session.post(hf_proxy.url + "/completion", json={
            "prompt": f"{PROMPT} {i}", "n_predict": 2000, "ignore_eos": True, "stream": True}) for i in range(16)))
        try:
            for stream in streams:
                assert (await stream.content.readline()).startswith(b"data: ")
            async with session.get(hf_proxy.url + "/slots") as response:
                assert all(slot["is_processing"] for slot in await response.json())
            async with session.get(hf_proxy.url + "/slots?fail_on_no_slot=1") as response:
                assert response.status == 503 and (await response.json())["error"] == {
                    "code": 503, "message": "no slot available", "type": "unavailable_error"}
        finally:
            for stream in streams:
                stream.close()
    await wait_released(hf_proxy)


async def test_a_server_default_max_tokens_seed_and_served_name(smollm2, start_proxy):
    """``backend.default_max_tokens`` (``--default-max-tokens``, llama-server's
    ``--n-predict``): a request with no bound gets that many tokens on every route and ends
    as a length stop; a request's own bound, higher or lower, stays its own.
    ``backend.seed`` (llama-server's ``--seed``): a sampled request that sets no seed draws
    as if it had set that one, on every route; its own seed stays its own; llama-server's
    ``seed: -1`` is random even so. ``backend.served_model_name`` (llama-server's
    ``--alias``): the name it is listed and answered under."""
    import ollama
    import openai

    from kvstream.config import Settings
    from kvstream.hf import HFBackend
    from kvstream.hf.loader import LoadedModel

    model, _, tokenizer = smollm2
    backend = HFBackend(None, None, Settings(backend={"type": "hf", "default_max_tokens": 5, "seed": 7,
                                                      "served_model_name": "tinyllama-2"}),
                        preloaded=LoadedModel(model, tokenizer, "smollm2", "hf:test"), block_size=16, num_gpu_blocks=64,
                        num_cpu_blocks=0, max_batch_size=4)
    proxy = await start_proxy(backend)
    await proxy.engine.start()
    try:
        async with aiohttp.ClientSession() as session:
            for body, predicted in (({}, 5), ({"n_predict": -1}, 5), ({"n_predict": 12}, 12), ({"n_predict": 3}, 3)):
                _, answer = await post(session, proxy.url + "/completion",
                                       {"prompt": PROMPT, "ignore_eos": True, "temperature": 0} | body)
                assert answer["tokens_predicted"] == predicted and answer["stop_type"] == "limit", (body, answer)
            async with session.get(proxy.url + "/props") as response:
                props = await response.json()
            defaults = props["default_generation_settings"]["params"]
            assert defaults["n_predict"] == 5 and defaults["seed"] == 7 and props["model_alias"] == "tinyllama-2"

            # Sampled at a high temperature: with no seed, the server's; -1 random.
            sampled = {"prompt": PROMPT, "ignore_eos": True, "temperature": 1.5, "top_k": 0, "top_p": 1.0,
                       "min_p": 0.0, "n_predict": 16, "return_tokens": True}
            answers = [(await post(session, proxy.url + "/completion", sampled | body))[1]
                       for body in ({}, {}, {"seed": 7}, {"seed": 8}, {"seed": -1}, {"seed": -1})]
            tokens = [answer["tokens"] for answer in answers]
            assert tokens[0] == tokens[1] == tokens[2] != tokens[3]
            assert tokens[4] != tokens[5] and tokens[0] not in tokens[4:]
            assert [a["generation_settings"]["seed"] for a in answers] == [7, 7, 7, 8, 0xFFFFFFFF, 0xFFFFFFFF]
            assert answers[0]["generation_settings"]["n_predict"] == 16
        async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            for kwargs, tokens in (({}, 5), ({"max_tokens": 12}, 12), ({"max_tokens": 2}, 2)):
                reply = await oa.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": "Count to a hundred, one number a line."}],
                    extra_body={"ignore_eos": True}, temperature=0, **kwargs)
                assert reply.usage.completion_tokens == tokens and reply.choices[0].finish_reason == "length", kwargs
            assert [m.id async for m in oa.models.list()] == ["tinyllama-2"]
            named = await oa.chat.completions.create(model="tinyllama-2", max_tokens=1,
                                                     messages=[{"role": "user", "content": "Hi"}])
            assert named.model == "tinyllama-2"
            texts = [(await oa.completions.create(model="tinyllama-2", prompt=PROMPT, max_tokens=16, temperature=1.5,
                                                  extra_body={"ignore_eos": True}, **seed)).choices[0].text
                     for seed in ({}, {}, {"seed": 7}, {"seed": 8})]
            assert texts[0] == texts[1] == texts[2] != texts[3]
        client = ollama.AsyncClient(host=proxy.url)
        options = {"temperature": 1.5, "num_predict": 16}
        generated = [(await client.generate(model="tinyllama-2", prompt=PROMPT, raw=True, options=options | seed)).response
                     for seed in ({}, {}, {"seed": 8})]
        assert generated[0] == generated[1] == texts[0] and generated[2] == texts[3]
    finally:
        await proxy.engine.close()


def llamacpp_series(text: str) -> dict[str, tuple[str, float]]:
    """``/metrics``' ``llamacpp:`` series as llama.cpp's server tests read them: each sample
    line named as its own TYPE line, {name: (type, value)}."""
    types, out = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE llamacpp:"):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:"):
            name, value = line.split(" ", 1)
            assert name in types and f"# HELP {name} " in text, name
            out[name] = (types[name], float(value))
    return out


async def test_metrics_carry_llama_servers_series(hf_proxy):
    """A dashboard written for llama-server's ``--metrics`` reads the embedded engine: its
    ``llamacpp:`` series, typed and named as llama-server writes them, counting what the
    answers' timings say (computed prompt tokens apart from cached ones, generated tokens,
    forward passes), and its ``Process-Start-Time-Unix`` header. The whole text still
    parses as Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    async def scrape(session: aiohttp.ClientSession) -> tuple[dict[str, tuple[str, float]], str]:
        async with session.get(hf_proxy.url + "/metrics") as response:
            assert response.status == 200 and int(response.headers["Process-Start-Time-Unix"]) > 0
            text = await response.text()
        return llamacpp_series(text), text

    prompt = "the quick brown fox jumps over the lazy dog, " * 4
    async with aiohttp.ClientSession() as session:
        before, _ = await scrape(session)
        timings = [(await post(session, hf_proxy.url + "/completion", {"prompt": prompt, "n_predict": n}))[1]["timings"]
                   for n in (4, 6)]
        after, text = await scrape(session)
    assert timings[1]["cache_n"] > 0  # the second prompt came from the prefix cache

    def grew(name: str) -> float:
        return after[f"llamacpp:{name}"][1] - before[f"llamacpp:{name}"][1]

    assert grew("prompt_tokens_total") == sum(t["prompt_n"] for t in timings)
    assert grew("prompt_tokens_cached_total") == sum(t["cache_n"] for t in timings)
    assert grew("tokens_predicted_total") == sum(t["predicted_n"] for t in timings) == 10
    assert grew("n_decode_total") >= 10 - 2  # each prompt's pass gives its first token
    assert grew("prompt_seconds_total") > 0 and grew("tokens_predicted_seconds_total") > 0
    assert after["llamacpp:n_tokens_max"][1] >= timings[0]["prompt_n"] + 4
    assert after["llamacpp:requests_processing"] == ("gauge", 0.0) and after["llamacpp:requests_deferred"][1] == 0
    assert after["llamacpp:n_busy_slots_per_decode"][1] >= 1
    for name in ("prompt_tokens_total", "n_tokens_max", "spec_decode_num_drafts_total"):
        assert after[f"llamacpp:{name}"][0] == "counter"
    for name in ("prompt_tokens_seconds", "predicted_tokens_seconds"):
        assert after[f"llamacpp:{name}"][0] == "gauge" and after[f"llamacpp:{name}"][1] > 0
    # The throughput gauges are since the previous scrape, as llama-server's: none since.
    async with aiohttp.ClientSession() as session:
        again, _ = await scrape(session)
    assert again["llamacpp:prompt_tokens_seconds"][1] == again["llamacpp:predicted_tokens_seconds"][1] == 0
    assert again["llamacpp:tokens_predicted_total"] == after["llamacpp:tokens_predicted_total"]
    assert {family.name for family in text_string_to_metric_families(text)} >= {"kvstream_requests", "llamacpp:n_tokens_max"}


def test_llamacpp_series_while_the_model_loads_are_zeros():
    """Before the in-process engine has its model, ``/metrics`` still writes llama-server's
    series, all zero (nothing run yet), and no end tokens are known to ban."""
    from kvstream.config import Settings
    from kvstream.engine import KVStreamEngine
    from kvstream.hf import HFBackend
    from kvstream.metrics import Metrics

    backend = HFBackend(None, None, Settings(backend={"type": "hf"}))
    assert backend.runner is None and backend.forward_passes() == (0, 0) and backend.end_token_ids() == ()
    engine = KVStreamEngine(backend, backend.settings)
    engine.attach_metrics(Metrics())
    series = llamacpp_series(engine.metrics.render().decode())
    assert series["llamacpp:n_decode_total"] == ("counter", 0.0)
    assert series["llamacpp:n_busy_slots_per_decode"] == ("gauge", 0.0)
    assert all(value == 0 for _, value in series.values())


async def test_return_progress_reports_the_prompt_as_it_is_computed(smollm2, start_proxy):
    """llama-server's ``return_progress``: a streamed answer reports its prompt's computation
    before the first token, one report at admission (what the cache held) and one after each
    chunk of the prompt computed (here at most 16 tokens a forward), on ``/completion``, the
    OpenAI routes (through the ``openai`` client) and the Responses API; ``timings_per_token``
    puts llama-server's timings on each event. The text is the text without them."""
    import openai

    from kvstream.config import Settings
    from kvstream.hf import HFBackend
    from kvstream.hf.loader import LoadedModel

    model, _, tokenizer = smollm2
    backend = HFBackend(None, None, Settings(backend={"type": "hf"}, scheduler={"max_num_batched_tokens": 16}),
                        preloaded=LoadedModel(model, tokenizer, "smollm2", "hf:test"), block_size=16, num_gpu_blocks=64,
                        num_cpu_blocks=0, max_batch_size=4)
    proxy = await start_proxy(backend, scheduler={"max_num_batched_tokens": 16})
    await proxy.engine.start()
    prompt = "The quick brown fox jumps over the lazy dog. " * 5
    total = len(tokenizer(prompt).input_ids)
    body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "stream": True}

    def checked(reports: list[dict], cache: int) -> None:
        assert reports[0] == {"total": total, "cache": cache, "processed": cache, "time_ms": 0}
        steps = [b["processed"] - a["processed"] for a, b in zip(reports, reports[1:])]
        assert all(0 < step <= 16 for step in steps) and reports[-1]["processed"] == total, reports
        assert len(reports) == 1 + -(-(total - cache) // 16)
        assert all(r["total"] == total and r["cache"] == cache for r in reports)
        assert [r["time_ms"] for r in reports] == sorted(r["time_ms"] for r in reports)

    try:
        async with aiohttp.ClientSession() as session:
            answers = []
            for _ in range(2):  # the second time, the prompt is in the prefix cache but its last token
                streamed = await events(session, proxy.url + "/completion",
                                        body | {"return_progress": True, "timings_per_token": True})
                reports = [e for e in streamed if "prompt_progress" in e]
                assert streamed[:len(reports)] == reports  # all before the first token
                cache = streamed[-1]["timings"]["cache_n"]
                assert cache == (total - 1 if answers else 0)
                checked([e["prompt_progress"] for e in reports], cache)
                first = reports[0]["timings"]
                assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0 and first["predicted_n"] == 0
                assert [e["timings"]["prompt_n"] for e in reports] == [e["prompt_progress"]["processed"] - cache
                                                                       for e in reports]
                tokens = streamed[len(reports):-1]
                assert [e["timings"]["predicted_n"] for e in tokens] == list(range(1, len(tokens) + 1))
                assert all(e["timings"]["cache_n"] == cache for e in tokens) and streamed[-1]["stop"] is True
                answers.append("".join(e["content"] for e in tokens))
            plain = await events(session, proxy.url + "/completion", body)
            assert not any("prompt_progress" in e or "timings" in e for e in plain[:-1])
            assert answers == ["".join(e["content"] for e in plain[:-1])] * 2
            # Not streamed: nothing to report it on.
            _, whole = await post(session, proxy.url + "/completion", body | {"stream": False, "return_progress": True})
            assert "prompt_progress" not in whole

        question = [{"role": "user", "content": prompt + "What jumps?"}]
        async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            chunks = [c async for c in await oa.chat.completions.create(
                model="smollm2", messages=question, max_tokens=5, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"return_progress": True, "timings_per_token": True})]
            reports = [c for c in chunks if (c.model_extra or {}).get("prompt_progress")]
            assert reports and all(c.choices[0].delta.content is None for c in reports)
            progress = [c.model_extra["prompt_progress"] for c in reports]
            assert progress[-1]["processed"] == progress[-1]["total"] == chunks[-1].usage.prompt_tokens
            assert len(progress) == 1 + -(-(progress[0]["total"] - progress[0]["cache"]) // 16)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            timed = [c.model_extra["timings"] for c in chunks if c.choices and c.choices[0].delta.content]
            assert [t["predicted_n"] for t in timed] == list(range(1, len(timed) + 1))
            assert chunks[-1].model_extra["timings"]["predicted_n"] == chunks[-1].usage.completion_tokens
            again = await oa.chat.completions.create(model="smollm2", messages=question, max_tokens=5, temperature=0)
            assert again.choices[0].message.content == text
            assert "prompt_progress" not in (again.model_extra or {})

            completion = [c async for c in await oa.completions.create(
                model="smollm2", prompt=prompt + "And then", max_tokens=3, temperature=0, stream=True,
                extra_body={"return_progress": True})]
            reported = [c.model_extra["prompt_progress"] for c in completion if (c.model_extra or {}).get("prompt_progress")]
            assert reported and reported[-1]["processed"] == reported[-1]["total"]
            assert all(c.choices[0].text == "" for c in completion if (c.model_extra or {}).get("prompt_progress"))

        async with aiohttp.ClientSession() as session:
            async with session.post(proxy.v1 + "/responses", json={
                "model": "smollm2", "input": prompt + "Who is lazy?", "max_output_tokens": 4, "stream": True,
                "return_progress": True, "timings_per_token": True,
            }) as response:
                lines = (await response.read()).decode().split("\n")
            sent = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
            reports = [e for e in sent if "prompt_progress" in e]
            assert reports and all(e["type"] == "response.in_progress" for e in reports)
            assert reports[-1]["prompt_progress"]["processed"] == reports[-1]["prompt_progress"]["total"]
            assert all("prompt_per_second" in e["timings"] for e in sent if e["type"] == "response.output_text.delta")
            assert sent[-1]["type"] == "response.incomplete" and sent[-1]["timings"]["predicted_n"] == 4  # cut at 4
    finally:
        await proxy.engine.close()


async def _stopped_while_running(session: aiohttp.ClientSession, proxy, url: str, body: dict, conv_id: str) -> bytes:
    """Start a long stream under ``conv_id`` and leave it after its first bytes, follow the
    recording, stop it with ``DELETE`` (204) and return what the follower got after that."""
    async with session.post(url, json=body, headers={"X-Conversation-Id": conv_id}) as response:
        await response.content.readany()
    async with session.get(f"{proxy.url}/v1/stream?conv_id={conv_id}") as follower:
        await follower.content.readany()
        async with session.delete(f"{proxy.url}/v1/stream?conv_id={conv_id}") as response:
            assert response.status == 204
        return await follower.read()


async def test_a_stream_sent_with_a_conversation_id_can_be_followed_again_and_stopped(hf_proxy):
    """llama-server's resumable streams: a chat streamed with ``X-Conversation-Id`` is
    recorded; ``GET /v1/stream`` replays it from any byte (live while it runs), it runs to its
    end when its client leaves, ``DELETE`` stops and forgets it, and another key's id is
    another stream."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 40, "temperature": 0, "stream": True}
    headers = {"X-Conversation-Id": "conv-1::org/model:Q8"}
    stream_url = hf_proxy.url + "/v1/stream?conv_id=" + "conv-1%3A%3Aorg%2Fmodel%3AQ8"
    async with aiohttp.ClientSession() as session:
        async with session.post(hf_proxy.v1 + "/chat/completions", json=body, headers=headers) as response:
            assert response.status == 200
            sent = await response.read()
        assert sent.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in sent
        async with session.get(stream_url + "&from=0") as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            assert await response.read() == sent
        async with session.get(stream_url + "&from=7") as response:
            assert await response.read() == sent[7:]
        async with session.get(stream_url) as response:  # from 0 by default
            assert await response.read() == sent

        # The client leaves after its first bytes: the generation goes on, and is there whole.
        left = {"X-Conversation-Id": "conv-2"}
        async with session.post(hf_proxy.v1 + "/chat/completions", json=body | {"max_tokens": 60, "ignore_eos": True},
                                headers=left) as response:
            await response.content.readany()
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=conv-2&from=0") as response:
            replay = await response.read()
        assert replay.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in replay

        # Stopped while it runs: the follower's answer ends without [DONE], the slot is free.
        rest = await _stopped_while_running(session, hf_proxy, hf_proxy.v1 + "/chat/completions",
                                            body | {"max_tokens": 2000, "ignore_eos": True}, "conv-3")
        assert b"[DONE]" not in rest
        for _ in range(100):
            if not hf_proxy.engine.scheduler.running:
                break
            await asyncio.sleep(0.05)
        assert not hf_proxy.engine.scheduler.running
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=conv-3") as response:
            assert response.status == 404
        async with session.delete(hf_proxy.url + "/v1/stream?conv_id=nothing") as response:
            assert response.status == 204  # as llama-server answers
        for query, status in (("", 400), ("?conv_id=conv-1&from=x", 400), ("?conv_id=unknown", 404)):
            async with session.get(hf_proxy.url + "/v1/stream" + query) as response:
                assert response.status == status, query
                assert set((await response.json())["error"]) == {"code", "message", "type"}


async def test_a_recorded_stream_the_engine_fails_ends_with_the_error_and_frees_everything(hf_proxy, monkeypatch):
    """The engine failing mid-way through a recorded stream (``X-Conversation-Id``): the
    recording ends with the error event and no ``[DONE]``, a follower leaving half-way leaves
    the recording whole, and the slot and blocks are released."""
    from tests.conftest import fail_forward_at, wait_released

    fail_forward_at(monkeypatch, 6)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 40,
            "temperature": 0, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(hf_proxy.v1 + "/chat/completions", json=body,
                                headers={"X-Conversation-Id": "failing"}) as response:
            assert response.status == 200
            sent = await response.read()
        assert b"[DONE]" not in sent and b'"error"' in sent and b'"content":' in sent
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=failing&from=0") as follower:
            assert await follower.content.readany()  # leaves after its first bytes
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=failing&from=0") as response:
            assert await response.read() == sent
        await wait_released(hf_proxy)
        assert not hf_proxy.engine._generations and hf_proxy.engine.scheduler.bm.is_idle()


async def test_a_completion_streamed_with_a_conversation_id_is_recorded_as_llama_server_does(hf_proxy):
    """llama-server records ``/completion`` streams sent with ``X-Conversation-Id`` too (its
    build here, asked the same: the replay is the stream): the replay is the events as sent,
    the generation runs to its end when its client leaves, ``DELETE`` stops it and frees the
    slot, and a refusal before the first token is still an HTTP error with its status."""
    from tests.conftest import wait_released

    body = {"prompt": "Once upon a time", "n_predict": 24, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(hf_proxy.url + "/completion", json=body, headers={"X-Conversation-Id": "c1"}) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            sent = await response.read()
        events = [json.loads(line[6:]) for line in sent.decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1]["stop"] is True and events[-1]["stop_type"] == "limit" and b"[DONE]" not in sent
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=c1&from=0") as response:
            assert await response.read() == sent
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=c1&from=9") as response:
            assert await response.read() == sent[9:]

        # The client leaves after its first event: the recording runs to its end.
        async with session.post(hf_proxy.url + "/completion", json=body | {"n_predict": 48, "ignore_eos": True},
                                headers={"X-Conversation-Id": "c2"}) as response:
            await response.content.readany()
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=c2&from=0") as response:
            replay = await response.read()
        assert b'"stop_type":"limit"' in replay and b'"tokens_predicted":48' in replay

        # Stopped while it runs: the follower ends without the final event, and the slot is freed.
        rest = await _stopped_while_running(session, hf_proxy, hf_proxy.url + "/completion",
                                            body | {"n_predict": 4000, "ignore_eos": True}, "c3")
        assert b'"stop":true' not in rest
        await wait_released(hf_proxy)
        assert not hf_proxy.engine._generations and hf_proxy.engine.scheduler.bm.is_idle()

        # A bad request is refused before anything is recorded.
        async with session.post(hf_proxy.url + "/completion", json=body | {"n_predict": "many"},
                                headers={"X-Conversation-Id": "c4"}) as response:
            assert response.status == 400
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=c4") as response:
            assert response.status == 404


@pytest.mark.parametrize("path, body, last", [
    ("/v1/responses", {"input": "Tell me a story.", "max_output_tokens": 16}, b"event: response.incomplete"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 16},
     b"event: message_stop"),
])
async def test_responses_and_messages_streams_with_a_conversation_id_are_recorded_too(hf_proxy, path, body, last):
    """llama-server records its Responses and Messages streams under ``X-Conversation-Id``
    as well (asked here: the replay is the stream); so does the embedded engine, and stopping
    one frees its slot."""
    from tests.conftest import wait_released

    body = {"model": "smollm2", "stream": True, "temperature": 0} | body
    async with aiohttp.ClientSession() as session:
        async with session.post(hf_proxy.url + path, json=body, headers={"X-Conversation-Id": "api-1"}) as response:
            assert response.status == 200
            sent = await response.read()
        assert last in sent
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=api-1&from=0") as response:
            assert await response.read() == sent
        long = body | ({"max_output_tokens": 4000} if "input" in body else {"max_tokens": 4000}) | {"ignore_eos": True}
        assert last not in await _stopped_while_running(session, hf_proxy, hf_proxy.url + path, long, "api-2")
        await wait_released(hf_proxy)
        assert not hf_proxy.engine._generations and hf_proxy.engine.scheduler.bm.is_idle()


@pytest.mark.parametrize("failing_step", [1, 6])
async def test_a_recorded_completion_the_engine_fails_is_an_error_either_way_and_frees_everything(
        hf_proxy, monkeypatch, failing_step):
    """``/completion`` with ``X-Conversation-Id`` and the engine failing: before the first
    token, the HTTP error and nothing recorded; mid-way, the recording (and its replay) ends
    with llama-server's error event, no final one. Everything is released either way."""
    from tests.conftest import fail_forward_at, wait_released

    fail_forward_at(monkeypatch, failing_step)
    body = {"prompt": "1, 2, 3, 4,", "n_predict": 40, "temperature": 0, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(hf_proxy.url + "/completion", json=body,
                                headers={"X-Conversation-Id": "broken"}) as response:
            status, sent = response.status, await response.read()
        async with session.get(hf_proxy.url + "/v1/stream?conv_id=broken&from=0") as replay:
            replay_status, replayed = replay.status, await replay.read()
        if failing_step == 1:
            assert status == 500 and json.loads(sent)["error"]["code"] == 500
            assert replay_status == 404
        else:
            events = [json.loads(line[6:]) for line in sent.decode().split("\n\n") if line.startswith("data: ")]
            assert status == 200 and events[0]["content"] and set(events[-1]) == {"error"}
            assert not any(event.get("stop") is True for event in events)
            assert replay_status == 200 and replayed == sent
        await wait_released(hf_proxy)
        assert not hf_proxy.engine._generations and hf_proxy.engine.scheduler.bm.is_idle()
