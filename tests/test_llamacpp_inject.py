"""Hard KV inject against the real llama-server: restore after a restart, verified by the
runtime's own cache_n; corrupt/missing files fall back to prefill; two replicas share a
directory; file names carry no user text and the byte budget holds."""

from __future__ import annotations

import re

import openai
import pytest

from kvstream.backends import LlamaCppBackend
from tests.conftest import launch_llama_server, stop_process

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(300)]

SYSTEM = (
    "You are the support assistant of the Lighthouse Bakery. The bakery opens at seven in the morning and "
    "closes at six in the evening, every day but Monday. It sells sourdough, rye, croissants, cinnamon rolls "
    "and seasonal fruit tarts. Orders for cakes need two days of notice. Deliveries go to addresses within "
    "ten kilometres for a fee of four euros. Answer briefly and politely, and never invent products. "
) * 4
FILE_NAME = re.compile(r"kvs-[0-9a-f]{12}-[0-9a-f]{32}\.bin")


def ask(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture
def server(tmp_path):
    servers = []

    def launch(**kw):
        s = launch_llama_server(slot_dir=kw.pop("slot_dir", tmp_path), **kw)
        servers.append(s)
        return s

    yield launch
    for s in servers:
        s.stop()


async def proxy_for(start_proxy, srv, slot_dir, **options):
    backend = LlamaCppBackend(srv.url, slot_save_path=str(slot_dir), **options)
    proxy = await start_proxy(backend)
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    return proxy, backend, client, model


async def chat(client, model, question, **kw):
    return await client.chat.completions.create(model=model, messages=ask(question), max_tokens=12, temperature=0, **kw)


async def test_restore_after_runtime_restart_is_verified_and_answers_like_the_cached_path(server, start_proxy, tmp_path):
    srv = server()
    proxy, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    first = await chat(client, model, "When do you open?")
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 300
    inject = backend.inject
    assert inject.enabled and inject.stats.saves == 1
    files = [p.name for p in tmp_path.glob("*.bin")]
    assert len(files) == 1 and FILE_NAME.fullmatch(files[0])
    # The runtime restarts: its own caches are gone.
    port = srv.url.rsplit(":", 1)[1]
    stop_process(srv.process)
    srv = server(port=int(port))
    second = await chat(client, model, "Do you sell rye bread?")
    assert inject.stats.restores == 1 and inject.stats.restore_failures == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 300, f"the restored prefix was not reused (cached_tokens={cached})"
    assert inject.stats.ineffective == 0
    # The same request on the runtime's own cached path gives the same answer.
    direct = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    again = await direct.chat.completions.create(model=model, messages=ask("Do you sell rye bread?"), max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 300
    assert again.choices[0].message.content == second.choices[0].message.content
    assert proxy.engine.scheduler.bm.is_idle()


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
async def test_a_damaged_slot_file_falls_back_to_prefill(server, start_proxy, tmp_path, damage):
    srv = server()
    proxy, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    await chat(client, model, "When do you open?")
    (path,) = list(tmp_path.glob("*.bin"))
    if damage == "corrupt":
        path.write_bytes(b"\x00garbage" * 1000)
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    else:
        path.unlink()
    damaged = path.read_bytes() if path.exists() else None
    backend.inject.reset()  # as after a restart: the slot's prefix must come from the file
    await backend.http.post_json("/slots/0?action=erase", {})
    await backend.http.post_json("/slots/1?action=erase", {})
    out = await chat(client, model, "Do you deliver?")
    assert out.choices[0].message.content  # still answered, by normal prefill
    stats = backend.inject.stats
    if damage == "delete":
        assert stats.restores == 0  # the index dropped the missing file on reload
    else:
        assert stats.restore_failures == 1 and stats.restores == 0
    assert stats.saves == 2  # the prefix was saved again after the fallback prefill
    assert not path.exists() or path.read_bytes() != damaged  # the damaged file is gone


async def test_two_replicas_share_a_slot_directory(server, start_proxy, tmp_path):
    a, b = server(), server()
    _, backend_a, client_a, model = await proxy_for(start_proxy, a, tmp_path)
    _, backend_b, client_b, _ = await proxy_for(start_proxy, b, tmp_path)
    await chat(client_a, model, "When do you open?")
    assert backend_a.inject.stats.saves == 1
    out = await chat(client_b, model, "Do you sell croissants?")
    assert backend_b.inject.stats.restores == 1
    assert out.usage.prompt_tokens_details.cached_tokens >= 300


async def test_byte_budget_evicts_least_recently_used_files(server, start_proxy, tmp_path):
    srv = server()
    _, backend, client, model = await proxy_for(start_proxy, srv, tmp_path, slot_budget_bytes=12_000_000)
    await client.chat.completions.create(model=model, messages=ask("When do you open?"), max_tokens=4, temperature=0)
    other = [{"role": "system", "content": "You are a pirate who talks about ships and the sea. " * 20}, {"role": "user", "content": "Ahoy?"}]
    await client.chat.completions.create(model=model, messages=other, max_tokens=4, temperature=0)
    files = list(tmp_path.glob("*.bin"))
    assert backend.inject.stats.saves == 2 and backend.inject.stats.evicted_files >= 1
    assert sum(p.stat().st_size for p in files) <= 12_000_000
    assert all(FILE_NAME.fullmatch(p.name) for p in files)


async def test_a_server_without_slot_saving_gets_soft_inject(server, start_proxy, tmp_path):
    srv = server(slot_saving=False)
    _, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    out = await chat(client, model, "When do you open?")
    assert out.choices[0].message.content
    assert backend.inject is not None and not backend.inject.enabled and backend.inject.store is None
    assert backend.describe()["hard_inject"]["off_reason"] == "llama-server was started without --slot-save-path"
    assert not list(tmp_path.glob("*.bin"))


async def test_inject_metrics_move(server, start_proxy, tmp_path):
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    srv = server()
    proxy, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    await chat(client, model, "When do you open?")
    backend.inject.reset()
    await backend.http.post_json("/slots/0?action=erase", {})
    await backend.http.post_json("/slots/1?action=erase", {})
    await chat(client, model, "Do you deliver?")
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/metrics") as resp:
            text = await resp.text()
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text) for x in f.samples}
    assert samples[("kvstream_hard_inject_enabled", ())] == 1
    assert samples[("kvstream_hard_inject_runtime_cache_trusted", ())] == 1
    assert samples[("kvstream_hard_inject_restores_total", (("result", "ok"),))] == 1
    assert samples[("kvstream_hard_inject_saves_total", ())] == 1
    assert samples[("kvstream_hard_inject_restored_tokens_total", ())] >= 300
    assert samples[("kvstream_hard_inject_disk_bytes", ())] > 0


async def test_a_request_waits_for_the_busy_slot_running_its_prefix(server, start_proxy, tmp_path):
    """Two requests with one long prefix at once on a 2-slot server: the second waits for
    the slot the first is computing the prefix in, and reuses it, instead of computing it
    again in the idle slot (and evicting what that slot held)."""
    import asyncio

    srv = server(slot_saving=False, extra=["--cache-ram", "0"])
    proxy, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    other = [{"role": "user", "content": "An unrelated question about the weather in Lisbon? " * 10}]
    await client.chat.completions.create(model=model, messages=other, max_tokens=2, temperature=0)
    backend.inject.prefill_tps = 10.0  # as on a slow machine: waiting beats recomputing
    first = asyncio.ensure_future(
        client.chat.completions.create(model=model, messages=ask("When do you open?"), max_tokens=48, temperature=0)
    )
    while not any(slot.busy for slot in backend.inject.table.slots):  # the first is running
        await asyncio.sleep(0.005)
    second = await chat(client, model, "Do you deliver?")
    assert (await first).usage.prompt_tokens_details.cached_tokens < 100
    assert second.usage.prompt_tokens_details.cached_tokens > 200  # reused from the first's slot
    assert backend.inject.stats.slot_waits >= 1


async def test_a_prefix_a_busy_slot_runs_is_restored_from_its_file_into_an_idle_slot(server, start_proxy, tmp_path):
    """Two requests with one long, saved prefix at once: the first runs in the slot holding
    it; the second gets it from the prefix's file in the idle slot (milliseconds) instead of
    waiting for the busy slot (as long as computing the prefix would take)."""
    import asyncio

    srv = server(extra=["--cache-ram", "0"])
    proxy, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    inject = backend.inject
    await chat(client, model, "When do you open?")  # computed once, and saved
    assert inject.stats.saves == 1
    inject.prefill_tps = 10.0  # as on a slow machine: the wait would be the longest allowed
    first = asyncio.ensure_future(  # (48 tokens whatever the model says: still running when the second comes)
        client.chat.completions.create(model=model, messages=ask("Tell me about the cakes."), max_tokens=48, temperature=0,
                                       extra_body={"ignore_eos": True})
    )
    while not any(slot.busy for slot in inject.table.slots):
        await asyncio.sleep(0.005)
    second = await chat(client, model, "Do you deliver?")
    assert inject.stats.slot_waits == 0 and inject.stats.restores == 1
    assert second.usage.prompt_tokens_details.cached_tokens >= 300  # from the file
    assert (await first).usage.prompt_tokens_details.cached_tokens >= 300  # from its slot


async def test_one_miss_of_a_runtime_cache_that_is_off_turns_to_the_slot_files(server, start_proxy, tmp_path):
    """llama-server's host-RAM prompt cache is trusted to hold prefixes it computed until it
    misses one: here it is off (--cache-ram 0, as Ollama's runner works), so the first
    revisit of an evicted prefix is computed again, and the next is restored from its file."""
    import asyncio

    srv = server(extra=["--cache-ram", "0"])
    proxy, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    inject = backend.inject

    async def evict(tag: str) -> None:  # two other long prompts at once take both slots
        await asyncio.gather(*(
            client.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                           messages=[{"role": "user", "content": f"{tag} {i}: " + "Tell me about ships. " * 40}])
            for i in range(2)))

    await chat(client, model, "When do you open?")
    await evict("first")
    missed = await chat(client, model, "Do you deliver?")
    assert missed.usage.prompt_tokens_details.cached_tokens < 100 and inject.stats.restores == 0
    assert not inject.trust_runtime_cache and inject.snapshot()["runtime_cache_trusted"] is False
    await evict("second")
    restored = await chat(client, model, "Do you sell rye bread?")
    assert inject.stats.restores == 1
    assert restored.usage.prompt_tokens_details.cached_tokens >= 300
    # A restarted runtime (its task ids in /slots going backwards) may run with other flags:
    # its cache is trusted again until it misses (before, the doubt outlived the restart).
    inject._max_task_seen = 10**9
    await chat(client, model, "Do you bake cakes?")
    assert inject.trust_runtime_cache and inject.snapshot()["runtime_cache_trusted"] is True


# A long prompt that shares nothing with SYSTEM (about 600 tokens).
LOG = [{"role": "user", "content": "Summarize the log. " + "The harbour master wrote down every ship that came in. " * 50}]


async def test_a_prompt_another_client_left_in_a_slot_is_found_through_kvstream(server, start_proxy, tmp_path):
    """Mixed traffic: a client talking to llama-server directly left a long prompt in slot 1
    before KVStream started. KVStream cannot know what the slot holds (/slots says only how
    many tokens), so it lets llama-server pick the slot for a request that may share them,
    as llama-server would for that client: the prompt is reused, not computed again in
    slot 0. Then it knows where the prompt is and pins the next one there."""
    srv = server()
    direct = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    model = (await direct.models.list()).data[0].id
    await direct.chat.completions.create(model=model, messages=ask("When do you open?"), max_tokens=2, temperature=0,
                                         extra_body={"id_slot": 0})
    first = await direct.chat.completions.create(model=model, messages=LOG, max_tokens=12, temperature=0, extra_body={"id_slot": 1})
    await direct.close()
    proxy, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    inject = backend.inject
    through = await client.chat.completions.create(model=model, messages=LOG, max_tokens=12, temperature=0)
    assert through.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert through.choices[0].message.content == first.choices[0].message.content
    assert inject.stats.left_to_runtime == 1 and inject.stats.foreign_uses == 0  # (there before KVStream: not counted)
    assert inject.table.slots[1].tokens and not inject.table.slots[1].unknown  # learned where it ran
    again = await client.chat.completions.create(model=model, messages=LOG, max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert inject.stats.left_to_runtime == 1  # pinned to the slot it now knows
    # Slot 0 still holds the other client's bakery prompt, which KVStream cannot name: a
    # request that shares it is left to llama-server too, and finds it.
    bakery = await chat(client, model, "Do you deliver?")
    assert bakery.usage.prompt_tokens_details.cached_tokens >= 300
    assert inject.stats.left_to_runtime == 2
    assert proxy.engine.scheduler.bm.is_idle()


async def test_a_slot_another_client_used_is_not_overwritten_by_kvstream(server, start_proxy, tmp_path):
    """Mixed traffic while KVStream runs: another client's long prompt lands in the slot
    KVStream believes holds its bakery prefix. KVStream sees the slot's new task in /slots,
    forgets its belief, and leaves the next request to llama-server, which puts it in the
    other slot: the other client's prompt survives (no host-RAM prompt cache here to save it:
    --cache-ram 0), and KVStream's own request for it reuses it."""
    srv = server(extra=["--cache-ram", "0"])
    proxy, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    inject = backend.inject
    await chat(client, model, "When do you open?")  # slot 0
    await client.chat.completions.create(model=model, max_tokens=2, temperature=0,  # slot 1
                                         messages=[{"role": "user", "content": "Tell me about trains. " * 30}])
    direct = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    first = await direct.chat.completions.create(model=model, messages=LOG, max_tokens=12, temperature=0, extra_body={"id_slot": 0})
    await direct.close()
    await chat(client, model, "Do you deliver?")  # (left to llama-server: slot 1)
    assert inject.stats.foreign_uses == 1
    through = await client.chat.completions.create(model=model, messages=LOG, max_tokens=12, temperature=0)
    assert through.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert through.choices[0].message.content == first.choices[0].message.content
    # Both slots are known again: the bakery prompt is pinned to its slot and reused.
    pinned = inject.stats.left_to_runtime
    bakery = await chat(client, model, "Is there parking?")
    assert bakery.usage.prompt_tokens_details.cached_tokens >= 300 and inject.stats.left_to_runtime == pinned
    snapshot = inject.snapshot()
    assert snapshot["foreign_slot_uses"] == 1 and snapshot["left_to_runtime"] == pinned


RAILWAY = (
    "You are the guide of the Blue Ridge mountain railway. Trains leave the valley station every hour from eight "
    "to five, and the ride to the summit takes forty minutes. Tickets cost twelve euros, children under six ride "
    "free, and dogs are welcome on a lead. The summit cafe serves soup and cake. Answer in one sentence. "
) * 4


async def test_two_conversations_taking_turns_keep_a_slot_each(server, start_proxy, tmp_path):
    """Two long system prompts taking turns on a 2-slot llama-server get a slot each, as
    llama-server gives them directly. Before, the second took the first's slot because the
    two share the chat template's first tokens (an empty slot shares none): one slot served
    both and, with no host-RAM cache and no slot files, every turn computed its prompt again."""
    srv = server(slot_saving=False, extra=["--cache-ram", "0"])
    proxy, backend, client, model = await proxy_for(start_proxy, srv, tmp_path)
    railway = [{"role": "system", "content": RAILWAY}, {"role": "user", "content": "When is the first train?"}]
    await chat(client, model, "When do you open?")
    await client.chat.completions.create(model=model, messages=railway, max_tokens=4, temperature=0)
    again = await chat(client, model, "Do you deliver?")
    assert again.usage.prompt_tokens_details.cached_tokens >= 300
    railway[1]["content"] = "Can I bring my dog?"
    back = await client.chat.completions.create(model=model, messages=railway, max_tokens=4, temperature=0)
    assert back.usage.prompt_tokens_details.cached_tokens >= back.usage.prompt_tokens - 20  # all but the question
    assert sorted(len(s.tokens) > 250 for s in backend.inject.table.slots) == [True, True]
