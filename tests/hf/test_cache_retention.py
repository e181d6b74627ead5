"""Prefixes a client asks to keep cached on the in-process engine: Anthropic's
``cache_control`` (the official ``anthropic`` client) and OpenAI's ``prompt_cache_retention``
(the official ``openai`` client). After a flood of other prompts that cycles a small pool, a
retained prefix is still found in the cache and an unmarked one is not."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

require_import("torch")
anthropic = require_import("anthropic")
openai = require_import("openai")

BLOCK = 16
SYSTEM_A = "Alpha desk. You answer questions about the alpha shipping schedule, in one short sentence. " * 5
SYSTEM_B = "Bravo desk. You answer questions about the bravo rail timetable, in one short sentence. " * 5
SYSTEM_C = "Charlie desk. You answer questions about charlie harbour tides, in one short sentence. " * 5


@pytest.fixture
async def small_proxy(smollm2, start_proxy):
    """48 blocks of 16 tokens: a few long prompts cycle the whole pool."""
    from kvstream.hf import HFBackend
    from kvstream.hf.loader import LoadedModel

    model, _, tokenizer = smollm2
    backend = HFBackend(None, None, preloaded=LoadedModel(model, tokenizer, "smollm2", "hf:test"), block_size=BLOCK,
                        num_gpu_blocks=48, num_cpu_blocks=0, max_batch_size=4)
    proxy = await start_proxy(backend)
    await proxy.engine.start()
    yield proxy, tokenizer
    await proxy.engine.close()


async def test_retained_prefixes_outlive_a_flood_that_evicts_the_others(small_proxy):
    import aiohttp

    from kvstream.hf.loader import chat_token_ids

    proxy, tokenizer = small_proxy
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa, \
            anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0) as claude:

        async def chat(system: str, question: str, **extra) -> openai.types.CompletionUsage:
            reply = await oa.chat.completions.create(
                model="smollm2", max_tokens=1, temperature=0, extra_body=extra or None,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
            return reply.usage

        async def ask_c(question: str) -> anthropic.types.Usage:
            message = await claude.messages.create(
                model="smollm2", max_tokens=1, system=[{"type": "text", "text": SYSTEM_C, "cache_control": {"type": "ephemeral"}}],
                messages=[{"role": "user", "content": question}], extra_body={"temperature": 0})
            return message.usage

        a = await chat(SYSTEM_A, "When does the first ship leave?", prompt_cache_retention="24h")  # all of it, a day
        b = await chat(SYSTEM_B, "When does the first train leave?")  # nothing asked
        c = await ask_c("When is high tide?")  # the system prompt, five minutes
        async with aiohttp.ClientSession() as http:
            kv = (await (await http.get(proxy.url + "/status")).json())["kv"]
        system_c = len(chat_token_ids(tokenizer, [{"role": "system", "content": SYSTEM_C}], generation_prompt=False))
        assert kv["blocks_retained"] == a.prompt_tokens // BLOCK + system_c // BLOCK

        for n in range(4):  # each ~13 blocks, cycling what is not retained
            await chat(f"Flood {n}. " + " ".join(f"item{n}-{i}" for i in range(60)), "Count them.")

        again_b = await chat(SYSTEM_B, "When does the first train leave?")
        assert again_b.prompt_tokens == b.prompt_tokens and again_b.prompt_tokens_details.cached_tokens == 0  # evicted
        again_a = await chat(SYSTEM_A, "When does the first ship leave?", prompt_cache_retention="24h")
        assert again_a.prompt_tokens_details.cached_tokens == (a.prompt_tokens - 1) // BLOCK * BLOCK  # all but the last token's block
        again_c = await ask_c("And low tide?")  # another question after the kept system prompt
        assert again_c.cache_read_input_tokens == system_c // BLOCK * BLOCK
        # Usage splits the prompt as Anthropic does: read, written under a mark (computed
        # now, up to the mark), the rest; OpenAI's cache_write_tokens the same.
        assert (c.cache_read_input_tokens, c.cache_creation_input_tokens) == (0, system_c) and c.input_tokens > 0
        assert again_c.cache_creation_input_tokens == system_c - again_c.cache_read_input_tokens  # the mark's last, partial block
        assert a.prompt_tokens_details.cache_write_tokens == a.prompt_tokens and b.prompt_tokens_details.cache_write_tokens is None
        assert again_a.prompt_tokens_details.cache_write_tokens == a.prompt_tokens - again_a.prompt_tokens_details.cached_tokens


async def test_malformed_marks_are_400s_in_each_api_s_shape(small_proxy):
    proxy, _ = small_proxy
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa, \
            anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0) as claude:
        with pytest.raises(openai.BadRequestError) as error:
            await oa.chat.completions.create(model="smollm2", max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
                                             extra_body={"prompt_cache_retention": "7d"})
        assert error.value.body["param"] == "prompt_cache_retention"
        with pytest.raises(openai.BadRequestError) as error:
            await oa.chat.completions.create(model="smollm2", max_tokens=1, messages=[
                {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}])
        assert "messages.0.content.0.cache_control.ttl" in error.value.message
        text = {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}
        with pytest.raises(anthropic.BadRequestError) as error:
            await claude.messages.create(model="smollm2", max_tokens=1, messages=[{"role": "user", "content": [text] * 5}])
        assert error.value.body["error"]["message"] == "A maximum of 4 blocks with cache_control may be provided. Found 5."
        with pytest.raises(anthropic.BadRequestError) as error:
            await claude.messages.create(model="smollm2", max_tokens=1, system=[text | {"cache_control": {"type": "forever"}}],
                                         messages=[{"role": "user", "content": "Hi"}])
        assert "system.0.cache_control" in error.value.body["error"]["message"]
        # Four are taken; the marks never reach the template: the same prompt as without them.
        marked = await claude.messages.create(model="smollm2", max_tokens=1, messages=[{"role": "user", "content": [text] * 4}],
                                              extra_body={"temperature": 0})
        plain = await claude.messages.create(model="smollm2", max_tokens=1, extra_body={"temperature": 0},
                                             messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}] * 4}])
        def prompt(usage) -> int:
            return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens

        assert prompt(marked.usage) == prompt(plain.usage) and plain.usage.cache_creation_input_tokens == 0


async def test_a_completions_batch_reports_what_its_prompts_wrote_under_retention(small_proxy):
    """A batch of prompts is answered with one usage: what each prompt wrote to the cache
    under ``prompt_cache_retention`` is summed like the rest of it."""
    proxy, tokenizer = small_proxy
    prompts = ["The alpha ship leaves the harbour at", "The bravo train leaves the station at"]
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
        kept = await oa.completions.create(model="smollm2", prompt=prompts, max_tokens=1, temperature=0,
                                           extra_body={"prompt_cache_retention": "24h"})
        plain = await oa.completions.create(model="smollm2", prompt=["Another", "Other"], max_tokens=1, temperature=0)
    tokens = sum(len(tokenizer(p).input_ids) for p in prompts)
    details = kept.usage.prompt_tokens_details  # (the second prompt may read the first's opening token)
    assert kept.usage.prompt_tokens == tokens and details.cache_write_tokens == tokens - details.cached_tokens > tokens // 2
    assert getattr(plain.usage.prompt_tokens_details, "cache_write_tokens", None) is None
