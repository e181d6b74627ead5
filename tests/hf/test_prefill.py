"""A chat that ends with the assistant's own text is continued, not answered, where the API
says so: Anthropic's Messages API and Ollama's chat always (the "prefill"), the OpenAI
route with vLLM's ``continue_final_message``. The answer is plain transformers' greedy
continuation of the template rendered with the last message left open."""

from __future__ import annotations

import aiohttp
import pytest

from tests.conftest import require_import

torch = require_import("torch")
anthropic = require_import("anthropic")
openai = require_import("openai")
ollama = require_import("ollama")

QUESTION = [{"role": "user", "content": "List three colours as a JSON array."}]
PREFILL = {"role": "assistant", "content": '["red", "'}


def continuation(smollm2, messages: list[dict], tokens: int) -> str:
    _, model, tokenizer = smollm2
    ids = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if hasattr(ids, "get") else ids)
    assert tokenizer.decode(ids).endswith(PREFILL["content"])  # open: no end of turn, no new header
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0][len(ids):], skip_special_tokens=True)


async def test_a_prefilled_answer_is_continued_by_each_api(hf_proxy, smollm2):
    expected = continuation(smollm2, [*QUESTION, PREFILL], 8)
    async with anthropic.AsyncAnthropic(base_url=hf_proxy.url, api_key="unused", max_retries=0) as claude:
        message = await claude.messages.create(model="smollm2", max_tokens=8, messages=[*QUESTION, PREFILL],
                                               extra_body={"temperature": 0})
    assert expected and message.content[0].text == expected

    reply = await ollama.AsyncClient(host=hf_proxy.url).chat(model="smollm2", messages=[*QUESTION, PREFILL],
                                                             options={"temperature": 0, "num_predict": 8})
    assert reply.message.content == expected

    async with openai.AsyncOpenAI(base_url=hf_proxy.v1, api_key="unused", max_retries=0) as oa:
        chat = await oa.chat.completions.create(model="smollm2", max_tokens=8, temperature=0, messages=[*QUESTION, PREFILL],
                                                extra_body={"continue_final_message": True, "add_generation_prompt": False})
        assert chat.choices[0].message.content == expected
        # Without the flag, OpenAI's meaning: the assistant's message is history, a new turn answers.
        plain = await oa.chat.completions.create(model="smollm2", max_tokens=8, temperature=0, messages=[*QUESTION, PREFILL])
        assert plain.usage.prompt_tokens > chat.usage.prompt_tokens
        for extra, param in (({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
                             ({"continue_final_message": True}, "continue_final_message")):
            with pytest.raises(openai.BadRequestError) as err:  # both at once; nothing of the assistant's to continue
                messages = [*QUESTION, PREFILL] if "add_generation_prompt" in extra else QUESTION
                await oa.chat.completions.create(model="smollm2", max_tokens=2, messages=messages, extra_body=extra)
            assert err.value.body["param"] == param, err.value.body

    async with aiohttp.ClientSession() as session:
        async with session.post(hf_proxy.url + "/apply-template",
                                json={"messages": [*QUESTION, PREFILL], "continue_final_message": True}) as response:
            assert (await response.json())["prompt"].endswith(PREFILL["content"])
