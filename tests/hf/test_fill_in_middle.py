"""Fill-in-the-middle on the in-process engine: a completion between a prompt and a
``suffix``, through the ``openai`` client's completions and the ``ollama`` client's
generate. SmolLM2 has no FIM tokens (it gets a 400: tests/hf/test_serving.py), so the
model here is SmolLM2 given Qwen2.5-Coder's three FIM tokens (its embeddings grown by
three rows): what is checked is the prompt built and the engine's text against plain
transformers' greedy text on the same ids, not what an untrained model writes."""

from __future__ import annotations

import copy

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
