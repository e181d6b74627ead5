"""Stored responses where KVStream answers the Responses API itself (here in front of Ollama's
native API; the in-process engine's side is in tests/hf/test_responses.py): continued with
``previous_response_id`` (the conversation rebuilt as the runtime receives it), read back,
listed, deleted, kept per API key, bounded; and passed through where the runtime answers the
API. Driven by the official ``openai`` client."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from kvstream.api.response_store import ResponseStore
from kvstream.backends import OllamaBackend, OpenAICompatibleBackend
from tests.conftest import wait_released
from tests.doubles import Script, ollama_double


@pytest.fixture
async def ollama_proxy(start_upstream, start_proxy):
    url, recorder = await start_upstream(Script(tokens=["Hel", "lo", "!"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    yield proxy, recorder
    await wait_released(proxy)


@pytest.fixture
async def client(ollama_proxy):
    async with openai.AsyncOpenAI(base_url=ollama_proxy[0].v1, api_key="unused", max_retries=0) as oa:
        yield oa


async def test_a_continued_response_is_prompted_with_the_whole_conversation(ollama_proxy, client):
    """Turn two names turn one: the runtime gets turn one's input and answer before the new
    input, this request's instructions only (OpenAI does not carry them over), and the
    continuation is itself continued the same way, streamed or not."""
    _, recorder = ollama_proxy
    first = await client.responses.create(model="llama3.2", instructions="Be brief.", input="Hi", max_output_tokens=8)
    assert first.store is True and first.previous_response_id is None
    second = await client.responses.create(model="llama3.2", instructions="Be kind.", input="And again?",
                                           previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id and second.output_text == "Hello!"
    assert recorder.bodies[-1]["messages"] == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And again?"}]
    async with client.responses.stream(model="llama3.2", previous_response_id=second.id,
                                       input=[{"role": "user", "content": [{"type": "input_text", "text": "Third"}]}]) as stream:
        third = await stream.get_final_response()
    assert recorder.bodies[-1]["messages"] == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And again?"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Third"}]
    again = await client.responses.retrieve(third.id)  # stored before the stream's last event
    assert (again.id, again.output_text, again.usage, again.previous_response_id) == (
        third.id, third.output_text, third.usage, second.id)


async def test_retrieve_and_list_input_items_as_the_client_reads_them(client):
    first = await client.responses.create(model="llama3.2", input="Hi", max_output_tokens=8)
    assert (await client.responses.retrieve(first.id)).model_dump() == first.model_dump()
    second = await client.responses.create(model="llama3.2", previous_response_id=first.id, max_output_tokens=8,
                                           input=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    items = [item async for item in client.responses.input_items.list(second.id, order="asc")]
    assert [(item.type, item.role) for item in items] == [("message", "user"), ("message", "assistant"),
                                                          ("message", "user"), ("message", "user")]
    assert [item.content[0].text for item in items] == ["Hi", "Hello!", "one", "two"]
    assert items[1].id == first.output[0].id and items[0].content[0].type == "input_text"
    newest = [item async for item in client.responses.input_items.list(second.id)]  # desc by default
    assert [item.id for item in newest] == [item.id for item in reversed(items)]
    page = await client.responses.input_items.list(second.id, limit=3, order="asc")
    assert [item.id for item in page.data] == [item.id for item in items[:3]] and page.has_more
    rest = await client.responses.input_items.list(second.id, limit=3, order="asc", after=page.data[-1].id)
    assert [item.id for item in rest.data] == [items[3].id] and not rest.has_more


async def test_function_calls_continue_with_their_output_alone(ollama_proxy, client):
    """A call in the stored conversation: the next request sends only the call's output, and
    the runtime gets the assistant's call and the tool's result."""
    _, recorder = ollama_proxy
    first = await client.responses.create(model="llama3.2", input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Oslo"}'}])
    await client.responses.create(model="llama3.2", previous_response_id=first.id,
                                  input=[{"type": "function_call_output", "call_id": "call_7", "output": "4 C"}])
    messages = recorder.bodies[-1]["messages"]
    assert messages[0] == {"role": "user", "content": "Weather?"}
    assert messages[1]["role"] == "assistant" and messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[2] == {"role": "assistant", "content": "Hello!"}
    assert messages[3]["role"] == "tool" and messages[3]["content"] == "4 C"
    items = [item async for item in client.responses.input_items.list(first.id, order="asc")]
    assert [item.type for item in items] == ["message", "function_call"] and items[1].call_id == "call_7"


async def test_an_item_reference_stands_for_the_stored_item(ollama_proxy, client):
    """A stored response's input and output items are named by id in a new request's input
    (``item_reference``), without previous_response_id; an unknown id is a 400 naming it."""
    _, recorder = ollama_proxy
    first = await client.responses.create(model="llama3.2", input="Hi")
    [asked] = [item async for item in client.responses.input_items.list(first.id)]
    await client.responses.create(model="llama3.2", input=[
        {"type": "item_reference", "id": asked.id}, {"type": "item_reference", "id": first.output[0].id},
        {"role": "user", "content": "Go on"}])
    assert recorder.bodies[-1]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                               {"role": "user", "content": "Go on"}]
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="llama3.2", input=[{"role": "user", "content": "x"},
                                                               {"type": "item_reference", "id": "msg_gone"}])
    assert err.value.param == "input[1].id" and "msg_gone" in err.value.message


async def test_unstored_deleted_and_unknown_responses(ollama_proxy, client):
    proxy, _ = ollama_proxy
    unstored = await client.responses.create(model="llama3.2", input="Hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="llama3.2", input="Hi", previous_response_id=unstored.id)
    assert err.value.code == "previous_response_not_found" and err.value.param == "previous_response_id"
    assert f"'{unstored.id}'" in err.value.message

    first = await client.responses.create(model="llama3.2", input="Hi")
    second = await client.responses.create(model="llama3.2", input="More", previous_response_id=first.id)
    await client.responses.delete(first.id)
    for call in (client.responses.retrieve(first.id), client.responses.delete(first.id),
                 client.responses.input_items.list(first.id), client.responses.cancel(first.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    third = await client.responses.create(model="llama3.2", input="Last", previous_response_id=second.id)
    assert len([item async for item in client.responses.input_items.list(third.id)]) == 5  # Hi, Hello!, More, Hello!, Last
    with pytest.raises(openai.BadRequestError):  # not a background response
        await client.responses.cancel(third.id)
    with pytest.raises(openai.BadRequestError) as err:  # counted as a generation would be: also looked up
        await client.responses.input_tokens.count(model="llama3.2", input="x", previous_response_id=first.id)
    assert err.value.code == "previous_response_not_found"
    assert proxy.engine.stats.requests_finished == 4


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
                                          ("order=up", "order"), ("after=msg_nope", "after")])
async def test_bad_list_queries_are_400s(ollama_proxy, client, query, param):
    first = await client.responses.create(model="llama3.2", input="Hi")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{ollama_proxy[0].v1}/responses/{first.id}/input_items?{query}") as resp:
            body = await resp.json()
    assert resp.status == 400 and body["error"]["param"] == param, body


async def test_hostile_continuations_are_400s_naming_the_clients_own_fields(client):
    first = await client.responses.create(model="llama3.2", input="Hi")
    for body, param in (({"previous_response_id": 5}, "previous_response_id"),
                        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),  # its own index, not the history's
                        ({"input": 7}, "input")):
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="llama3.2", **({"previous_response_id": first.id, "input": "x"} | body))
        assert err.value.param == param


async def test_each_key_sees_only_its_own_responses(start_upstream, start_proxy):
    url, _ = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url), server={"api_keys": ["sk-a", "sk-b"]})
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="sk-a", max_retries=0) as a, \
            openai.AsyncOpenAI(base_url=proxy.v1, api_key="sk-b", max_retries=0) as b:
        mine = await a.responses.create(model="llama3.2", input="secret")
        assert (await a.responses.retrieve(mine.id)).id == mine.id
        for call in (b.responses.retrieve(mine.id), b.responses.delete(mine.id), b.responses.input_items.list(mine.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        with pytest.raises(openai.BadRequestError):
            await b.responses.create(model="llama3.2", input="x", previous_response_id=mine.id)
        assert (await a.responses.retrieve(mine.id)).id == mine.id  # b's delete did not touch it
    await wait_released(proxy)


async def test_with_storing_off_nothing_is_kept(start_upstream, start_proxy, http):
    url, _ = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url), server={"responses_max_stored": 0})
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        reply = await client.responses.create(model="llama3.2", input="Hi")
        assert reply.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(reply.id)
    async with http.get(proxy.url + "/status") as resp:
        assert (await resp.json())["responses"]["stored"] == 0
    await wait_released(proxy)


async def test_in_front_of_an_openai_runtime_the_stored_routes_are_the_runtimes(start_upstream, start_proxy, http):
    url, _ = await start_upstream(Script())
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    for method, path in (("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                         ("GET", "/v1/responses/resp_1/input_items?limit=2"), ("POST", "/v1/responses/resp_1/cancel")):
        async with http.request(method, proxy.url + path) as resp:
            # The double serves none of these: its web server's own 404, not KVStream's JSON.
            assert (resp.status, await resp.text()) == (404, "404: Not Found")


def _response(n: int, text: str = "x") -> dict:
    return {"id": f"resp_{n}", "output": [{"id": f"msg_{n}", "type": "message", "content": [{"text": text}]}]}


def test_the_store_evicts_least_recently_used_by_count_and_bytes():
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    for n in range(3):
        assert store.put(None, _response(n), (), ())
    assert store.get(None, "resp_0") is None and len(store) == 2 and store.evicted == 1
    store.get(None, "resp_1")  # now the most recent
    store.put(None, _response(3), (), ())
    assert store.get(None, "resp_2") is None and store.get(None, "resp_1") is not None

    small = ResponseStore(max_responses=100, max_bytes=400)
    assert not small.put(None, _response(0, "y" * 500), (), ())  # larger than the whole budget: not kept
    for n in range(10):
        small.put(None, _response(n), (), ())
    assert small.bytes <= 400 and len(small) < 10 and small.get(None, "resp_9") is not None
    assert small.bytes == sum(stored.size for stored in small._responses.values())
    assert small.delete(None, "resp_9") and not small.delete(None, "resp_9") and small.get(None, "resp_9") is None


def test_a_continuation_keeps_its_conversation_when_earlier_responses_leave():
    store = ResponseStore(max_responses=1, max_bytes=10_000)
    store.put(None, _response(0), (), ({"id": "msg_in0"},))
    first = store.get(None, "resp_0")
    store.put(None, _response(1), first.conversation(), ({"id": "msg_in1"},))
    assert store.get(None, "resp_0") is None  # evicted
    assert [item["id"] for item in store.get(None, "resp_1").conversation()] == ["msg_in0", "msg_0", "msg_in1", "msg_1"]
    assert store.get("another-key", "resp_1") is None


async def test_a_conversation_collects_its_responses_turns(ollama_proxy, client):
    """``conversation``: each response reads the conversation's items before its input, and
    its input and output are added to it; the items are listed, read, added and deleted
    through ``client.conversations``."""
    _, recorder = ollama_proxy
    conversation = await client.conversations.create(items=[{"role": "user", "content": "Hi"}], metadata={"topic": "x"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "x"}
    first = await client.responses.create(model="llama3.2", input="Still there?", conversation=conversation.id)
    assert first.conversation.id == conversation.id
    assert recorder.bodies[-1]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Still there?"}]
    async with client.responses.stream(model="llama3.2", input="Bye", conversation={"id": conversation.id}) as stream:
        await stream.get_final_response()
    assert recorder.bodies[-1]["messages"] == [
        {"role": "user", "content": "Hi"}, {"role": "user", "content": "Still there?"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"}]
    items = [item async for item in client.conversations.items.list(conversation.id, order="asc")]
    assert [getattr(item, "role", None) for item in items] == ["user", "user", "assistant", "user", "assistant"]
    assert items[2].id == first.output[0].id
    newest = await client.conversations.items.list(conversation.id, limit=2)
    assert [item.id for item in newest.data] == [items[4].id, items[3].id] and newest.has_more

    added = await client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "Later"}])
    assert added.data[0].content[0].text == "Later"
    read = await client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
    assert read.id == added.data[0].id
    after = await client.conversations.items.delete(items[0].id, conversation_id=conversation.id)
    assert after.id == conversation.id
    await client.responses.create(model="llama3.2", input="Again", conversation=conversation.id)
    assert recorder.bodies[-1]["messages"][0] == {"role": "user", "content": "Still there?"}  # "Hi" deleted
    assert recorder.bodies[-1]["messages"][-2:] == [{"role": "user", "content": "Later"}, {"role": "user", "content": "Again"}]

    updated = await client.conversations.update(conversation.id, metadata={"topic": "y"})
    assert updated.metadata == {"topic": "y"} and (await client.conversations.retrieve(conversation.id)).metadata == {"topic": "y"}
    deleted = await client.conversations.delete(conversation.id)
    assert deleted.deleted and deleted.id == conversation.id
    for call in (client.conversations.retrieve(conversation.id), client.conversations.items.list(conversation.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="llama3.2", input="x", conversation=conversation.id)
    assert err.value.param == "conversation"


async def test_bad_conversation_requests_are_400s_naming_the_field(client):
    conversation = await client.conversations.create()
    first = await client.responses.create(model="llama3.2", input="Hi")
    cases = [
        (client.responses.create(model="llama3.2", input="x", conversation=conversation.id, previous_response_id=first.id),
         "conversation"),
        (client.responses.create(model="llama3.2", input="x", conversation={"name": "x"}), "conversation"),
        (client.conversations.create(items=[{"role": "robot", "content": "x"}]), "items[0].role"),
        (client.conversations.create(items=[{"role": "user", "content": "x"}] * 21), "items"),
        (client.conversations.create(metadata={"k": 5}), "metadata"),
        (client.conversations.update(conversation.id, metadata={str(i): "v" for i in range(17)}), "metadata"),
        (client.conversations.items.create(conversation.id, items=[]), "items"),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            await call
        assert err.value.param == param, err.value.message
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.retrieve("msg_nope", conversation_id=conversation.id)


async def test_a_conversation_is_its_keys_and_bounded(start_upstream, start_proxy):
    url, _ = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url), server={"api_keys": ["sk-a", "sk-b"], "responses_max_bytes": 2000})
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="sk-a", max_retries=0) as a, \
            openai.AsyncOpenAI(base_url=proxy.v1, api_key="sk-b", max_retries=0) as b:
        mine = await a.conversations.create(items=[{"role": "user", "content": "secret"}])
        with pytest.raises(openai.NotFoundError):
            await b.conversations.retrieve(mine.id)
        with pytest.raises(openai.BadRequestError):
            await b.responses.create(model="llama3.2", input="x", conversation=mine.id)
        # One conversation past the byte budget takes no further turn.
        for _ in range(20):
            try:
                await a.responses.create(model="llama3.2", input="x" * 200, conversation=mine.id, store=False)
            except openai.BadRequestError as err:
                assert err.param == "conversation" and "start a new one" in err.message
                break
        else:
            raise AssertionError("the conversation grew without bound")
    await wait_released(proxy)


async def test_in_front_of_an_openai_runtime_conversations_are_the_runtimes(start_upstream, start_proxy, http):
    url, _ = await start_upstream(Script())
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    for method, path in (("POST", "/v1/conversations"), ("GET", "/v1/conversations/conv_1"),
                         ("GET", "/v1/conversations/conv_1/items"), ("DELETE", "/v1/conversations/conv_1/items/msg_1")):
        async with http.request(method, proxy.url + path, json={} if method == "POST" else None) as resp:
            assert (resp.status, await resp.text()) == (404, "404: Not Found")


@pytest.mark.parametrize("path, body", [
    ("/v1/conversations", b"[]"), ("/v1/conversations", b"null"), ("/v1/conversations", b"{"),
    ("/v1/conversations", b'{"items": "x"}'), ("/v1/conversations", b'{"items": [5]}'),
    ("/v1/conversations", b'{"items": [{"type": "function_call"}]}'), ("/v1/conversations", b'{"metadata": []}'),
    ("/v1/conversations", b'{"metadata": {"k": "' + b"v" * 513 + b'"}}'),
    ("/v1/responses", b'{"input": "x", "conversation": 5}'), ("/v1/responses", b'{"input": "x", "conversation": {"id": 5}}'),
    ("/v1/responses", b'{"input": [{"type": "item_reference"}]}'), ("/v1/responses", b'{"input": "x", "previous_response_id": []}'),
])
async def test_hostile_store_bodies_are_400s_never_500s(ollama_proxy, http, path, body):
    async with http.post(ollama_proxy[0].url + path, data=body, headers={"Content-Type": "application/json"}) as resp:
        answer = await resp.json()
    assert resp.status == 400 and set(answer["error"]) == {"message", "type", "param", "code"}, answer


async def test_a_response_the_runtime_failed_is_not_stored(start_upstream, start_proxy, http):
    """The runtime answering an error, or failing mid-stream: nothing is stored, and the
    conversation it was made in gains nothing."""
    for script in (Script(status=500), Script(tokens=["Hel", "lo"], error_after=1)):
        url, _ = await start_upstream(script, factory=ollama_double)
        proxy = await start_proxy(OllamaBackend(url))
        async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
            conversation = await client.conversations.create()
            if script.status:
                with pytest.raises(openai.APIStatusError):
                    await client.responses.create(model="llama3.2", input="Hi", conversation=conversation.id)
            else:
                stream = await client.responses.create(model="llama3.2", input="Hi", stream=True, conversation=conversation.id)
                kinds = [event.type async for event in stream]
                assert kinds[-1] == "error" and "response.completed" not in kinds
            assert [item async for item in client.conversations.items.list(conversation.id)] == []
        async with http.get(proxy.url + "/status") as resp:
            assert (await resp.json())["responses"]["stored"] == 0
        await wait_released(proxy)


async def test_truncation_auto_drops_the_earliest_items_until_the_prompt_fits(ollama_proxy, client):
    """A conversation past the runtime's context (4,096 tokens here): a 400 by default, as
    OpenAI answers; with ``truncation: "auto"`` the runtime gets the instructions and the
    latest items that fit, never a tool's result without its call, and the stored response
    keeps the whole conversation."""
    _, recorder = ollama_proxy
    long = "word " * 300  # some 375 estimated tokens
    items: list = []
    for n in range(12):
        items += [{"role": "user", "content": f"{n}: {long}"},
                  {"type": "function_call", "call_id": f"call_{n}", "name": "look", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"call_{n}", "output": long}]
    items.append({"role": "user", "content": "And now?"})
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="llama3.2", instructions="Be brief.", input=items, max_output_tokens=100)
    assert err.value.code == "context_length_exceeded"
    reply = await client.responses.create(model="llama3.2", instructions="Be brief.", input=items, max_output_tokens=100,
                                          truncation="auto")
    assert reply.truncation == "auto" and reply.output_text == "Hello!"
    sent = recorder.bodies[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "Be brief."} and sent[-1]["content"] == "And now?"
    assert sent[1]["role"] != "tool" and 3 < len(sent) < 1 + len(items)
    # The fewest dropped: one more item would not have fit.
    kept_from = next(n for n in range(12) if sent[1]["content"].startswith(f"{n}:")) if sent[1]["role"] == "user" else None
    assert kept_from is not None and kept_from > 0
    assert len([item async for item in client.responses.input_items.list(reply.id, limit=100)]) == len(items)
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="llama3.2", input="x", extra_body={"truncation": "sometimes"})
    assert err.value.param == "truncation"
