"""CORS where KVStream is the runtime (the in-process engine): a browser page of an allowed
origin may call it, preflight and answer (streamed too), behind its keys; any other origin
gets no grant. In front of a runtime the runtime's own CORS answers (tests/test_transparency.py)."""

from __future__ import annotations

import aiohttp
import pytest

from kvstream.api.cors import origin_allowed
from tests.conftest import require_import

require_import("torch")
KEY = "sk-test"
APP = "https://app.example.com"


def test_which_origins_are_allowed():
    local = ["localhost"]
    for origin in ("http://localhost", "http://localhost:3000", "https://127.0.0.1:8443", "http://[::1]:5173"):
        assert origin_allowed(origin, local), origin
    for origin in ("http://localhost.evil.com", "http://evil.com", "null", "", "file://localhost", "http://[::1"):
        assert not origin_allowed(origin, local), origin
    assert origin_allowed(APP, [APP + "/"]) and not origin_allowed(APP + ":444", [APP])
    assert origin_allowed("http://evil.com", ["*"]) and not origin_allowed("http://evil.com", [])


@pytest.fixture
async def guarded_proxy(smollm2, start_proxy):
    from kvstream.hf import HFBackend
    from kvstream.hf.loader import LoadedModel

    model, _, tokenizer = smollm2
    backend = HFBackend(None, None, preloaded=LoadedModel(model, tokenizer, "smollm2", "hf:test"), block_size=16,
                        num_gpu_blocks=64, num_cpu_blocks=0, max_batch_size=4)
    proxy = await start_proxy(backend, server={"api_keys": [KEY], "cors_origins": ["localhost", APP]})
    await proxy.engine.start()
    yield proxy
    await proxy.engine.close()


async def test_an_allowed_page_may_call_the_engine_and_others_get_no_grant(guarded_proxy):
    url = guarded_proxy.url + "/v1/chat/completions"
    body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    async with aiohttp.ClientSession() as http:
        for origin in ("http://localhost:5173", APP):
            # The preflight: no key (browsers send none), answered at once.
            async with http.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                  "Access-Control-Request-Headers": "authorization, content-type"}) as resp:
                assert resp.status == 200
                assert resp.headers["Access-Control-Allow-Origin"] == origin
                assert resp.headers["Access-Control-Allow-Credentials"] == "true"
                assert resp.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
                assert "POST" in resp.headers["Access-Control-Allow-Methods"]
            for stream in (False, True):
                async with http.post(url, json=body | {"stream": stream},
                                     headers={"Origin": origin, "Authorization": f"Bearer {KEY}"}) as resp:
                    await resp.read()
                    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == origin
                    assert "X-Request-Id" in resp.headers["Access-Control-Expose-Headers"]
            # An error answer carries the grant too, so that the page can read why.
            async with http.post(url, json=body, headers={"Origin": origin}) as resp:
                assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == origin

        evil = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
        async with http.options(url, headers=evil) as resp:
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
        async with http.post(url, json=body, headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
            assert "Origin" in resp.headers.getall("Vary")
        # Without an Origin (not a browser's cross-origin call) nothing changes.
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
        # An OPTIONS without Access-Control-Request-Method is not a preflight: it goes to the
        # routes like any request (none serves it here), with only the answer's grant.
        async with http.options(url, headers={"Origin": APP}) as resp:
            assert resp.status != 200 and "Access-Control-Allow-Methods" not in resp.headers
            assert resp.headers["Access-Control-Allow-Origin"] == APP
