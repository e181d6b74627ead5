"""Fill-in-the-middle on the in-process engine: a completion between a prompt and a
``suffix``, through the ``openai`` client's completions and the ``ollama`` client's
generate. SmolLM2 has no FIM tokens (it gets a 400: tests/hf/test_serving.py), so the
model here is SmolLM2 given Qwen2.5-Coder's three FIM tokens (its embeddings grown by
three rows): what is checked is the prompt built and the engine's text against plain
transformers' greedy text on the same ids, not what an untrained model writes."""

from __future__ import annotations

import copy
import json

import openai
import pytest

from kvstream.hf.fill_in_middle import end_ids, fim_prompt_ids, fim_tokens
from tests.conftest import require_import

require_import("torch")

PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
SPELLING = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


@pytest.fixture(scope="module")
def coder(smollm2):
    """(engine model, reference model, tokenizer): a fresh SmolLM2 with the FIM tokens."""
    from kvstream.hf.loader import load_model

    loaded = load_model(None, device="cpu")  # its own tokenizer: the added tokens stay here
    loaded.tokenizer.add_special_tokens({"additional_special_tokens": SPELLING})
    loaded.model.resize_token_embeddings(len(loaded.tokenizer))
    return loaded.model, copy.deepcopy(loaded.model), loaded.tokenizer


@pytest.fixture
async def coder_proxy(coder, start_proxy):
    from kvstream.hf import HFBackend
    from kvstream.hf.loader import LoadedModel

    model, _, tokenizer = coder
    backend = HFBackend(None, None, preloaded=LoadedModel(model, tokenizer, "coder", "hf:test-fim"), block_size=16,
                        num_gpu_blocks=64, num_cpu_blocks=16, max_batch_size=4)
    proxy = await start_proxy(backend)
    await proxy.engine.start()
    yield proxy
    await proxy.engine.close()


def test_the_prompt_is_prefix_suffix_middle_in_the_models_own_tokens(coder, smollm2):
    _, _, tokenizer = coder
    tokens = fim_tokens(tokenizer)
    assert tokens == tuple(tokenizer.convert_tokens_to_ids(SPELLING))
    ids = fim_prompt_ids(tokenizer, tokens, PREFIX, SUFFIX)
    assert tokenizer.decode(ids) == f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    assert fim_tokens(smollm2[2]) is None  # SmolLM2 as shipped has none
    assert [tokenizer.convert_ids_to_tokens(i) for i in end_ids(tokenizer)] == ["<file_sep>", "<repo_name>"]


async def test_a_completion_with_a_suffix_is_transformers_greedy_middle(coder, coder_proxy):
    import ollama
    import torch

    _, reference, tokenizer = coder
    ids = fim_prompt_ids(tokenizer, fim_tokens(tokenizer), PREFIX, SUFFIX)
    out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0][len(ids):].tolist()
    ends = set(end_ids(tokenizer))  # (SmolLM2's vocabulary has <file_sep> and <repo_name>)
    written = out[:next((i for i, token in enumerate(out) if token in ends), len(out))]
    expected = tokenizer.decode(written, skip_special_tokens=True)
    async with openai.AsyncOpenAI(base_url=coder_proxy.v1, api_key="unused", max_retries=0) as oa:
        reply = await oa.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0)
        assert expected and reply.usage.prompt_tokens == len(ids) and reply.choices[0].text == expected
        for kwargs in ({"suffix": SUFFIX, "echo": True}, {"suffix": 5}):
            with pytest.raises(openai.BadRequestError) as err:
                await oa.completions.create(model="coder", prompt=PREFIX, max_tokens=2, extra_body=kwargs)
            assert err.value.param == "suffix"
        with pytest.raises(openai.BadRequestError) as err:
            await oa.chat.completions.create(model="coder", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                             extra_body={"suffix": SUFFIX})
        assert err.value.param == "suffix"
    # Ollama's generate with a suffix: the same completion (what editors' Ollama plugins send).
    reply = await ollama.AsyncClient(host=coder_proxy.url).generate(
        model="coder", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 12})
    assert reply.response == expected


# ------------------------------------------------------------------ llama-server's /infill

OTHER_FILE = ("util.py", "def helper():\n    return 1\n")


def test_the_infill_prompt_is_llama_servers_repository_level_layout(coder):
    from kvstream.hf.fill_in_middle import InfillWindow, infill_prompt_ids

    _, _, tokenizer = coder
    tokens = fim_tokens(tokenizer)
    wide = InfillWindow(batch=2048, context=8192, n_predict=16)
    ids = infill_prompt_ids(tokenizer, tokens, PREFIX, SUFFIX, [OTHER_FILE], "result = ", wide)
    # SmolLM2's vocabulary has StarCoder's repository and file separator tokens: the other
    # file goes under them, then the current file's name, then prefix (+ prompt), suffix, middle.
    assert tokenizer.decode(ids) == (f"<repo_name>myproject\n<file_sep>{OTHER_FILE[0]}\n{OTHER_FILE[1]}"
                                     f"<file_sep>filename\n<|fim_prefix|>{PREFIX}result = <|fim_suffix|>{SUFFIX}"
                                     "<|fim_middle|>")
    # A special token's spelling in the code is text there, not the token.
    spelled = infill_prompt_ids(tokenizer, tokens, "<|fim_middle|>", "", [], "", wide)
    assert spelled.count(tokens[2]) == 1

    # Each part cut as llama-server cuts it: the prefix keeps its last 3/4 of a batch, the
    # suffix its first quarter less the prompt and two, other files their last tokens.
    prefix_ids = tokenizer.encode("x = 1\n" * 40, add_special_tokens=False)
    suffix_ids = tokenizer.encode("y = 2\n" * 40, add_special_tokens=False)
    narrow = InfillWindow(batch=64, context=64 + 2 * 4 + 10, n_predict=4)
    ids = infill_prompt_ids(tokenizer, tokens, "x = 1\n" * 40, "y = 2\n" * 40, [OTHER_FILE], "z", narrow)
    start, hole = ids.index(tokens[0]), ids.index(tokens[1])
    assert len(ids[:start]) == 10  # other files: what the context leaves
    assert ids[start + 1:hole] == prefix_ids[-48:] + tokenizer.encode("z", add_special_tokens=False)
    assert ids[hole + 1:-1] == suffix_ids[:64 // 4 - 2 - 1] and ids[-1] == tokens[2]


async def test_infill_is_transformers_greedy_middle_in_llama_servers_shape(coder, coder_proxy):
    import aiohttp
    import torch

    from kvstream.hf.fill_in_middle import InfillWindow, infill_prompt_ids
    from tests.conftest import wait_released

    _, reference, tokenizer = coder
    ids = infill_prompt_ids(tokenizer, fim_tokens(tokenizer), PREFIX, SUFFIX, [OTHER_FILE], "",
                            InfillWindow(2048, reference.config.max_position_embeddings, 12))
    out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0][len(ids):].tolist()
    ends = set(end_ids(tokenizer)) | {tokenizer.eos_token_id}
    written = out[:next((i for i, token in enumerate(out) if token in ends), len(out))]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 12, "temperature": 0, "return_tokens": True,
            "input_extra": [{"filename": OTHER_FILE[0], "text": OTHER_FILE[1]}],
            # what llama.vscode sends along: taken, changing nothing here
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000}
    async with aiohttp.ClientSession() as session:
        async with session.post(coder_proxy.url + "/infill", json=body) as response:
            assert response.status == 200
            whole = await response.json()
        assert written and whole["tokens"] == written and whole["content"] == tokenizer.decode(written)
        assert whole["tokens_evaluated"] == len(ids) and whole["stop"] is True and whole["prompt"] == tokenizer.decode(ids)
        assert whole["stop_type"] == ("limit" if len(written) == 12 else "eos")

        # Streamed: the same tokens as data events, the last one stop: true.
        async with session.post(coder_proxy.url + "/infill", json=body | {"stream": True}) as response:
            text = (await response.read()).decode()
        chunks = [json.loads(line.removeprefix("data: ")) for line in text.split("\n") if line]
        assert [t for c in chunks for t in c["tokens"]] == written and chunks[-1]["stop"] is True
        assert chunks[-1]["timings"]["cache_n"] > 0  # the second time, the prompt is the prefix cache's

        # llama-server's own server tests' bad input_extra: each a 400 in its shape.
        for extra in ({}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                      {"filename": 123, "text": 456}):
            async with session.post(coder_proxy.url + "/infill", json=body | {"input_extra": [extra]}) as response:
                error = await response.json()
                assert response.status == 400 and error["error"]["type"] == "invalid_request_error", error
        for bad, message in (({"input_prefix": None}, '"input_prefix" must be a string'),
                             ({"prompt": 5}, '"prompt" must be a string'),
                             ({"input_extra": "x"}, '"input_extra" must be an array')):
            async with session.post(coder_proxy.url + "/infill", json=body | bad) as response:
                error = await response.json()
                assert response.status == 400 and error["error"]["message"].startswith(message), error
        async with session.post(coder_proxy.url + "/infill", json={"input_suffix": SUFFIX}) as response:
            assert response.status == 400 and (await response.json())["error"]["message"] == '"input_prefix" is required'
    await wait_released(coder_proxy)
    assert not coder_proxy.engine._generations
