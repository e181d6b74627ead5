"""Hostile and careless clients against the real server process (issue 18's probe list).

``kvstream serve --backend openai`` runs as a subprocess, as users run it, in front of an
upstream double (also its own process), with small limits so that every probe is bounded
in time. Loopback only. Each test says what a client did and what it must not achieve:
stall others, keep a slot, crash a handler, read a secret, or see another tenant's cache.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("tenant-a-key", "tenant-b-key")
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}


def start_upstream(script: str = "Script()") -> tuple[subprocess.Popen, str]:
    """The OpenAI double in its own process, scripted by ``script`` (Python source)."""
    port = free_port()
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from aiohttp import web\n"
        "from tests.doubles import Script, Recorder, openai_upstream\n"
        f"web.run_app(openai_upstream({script}, Recorder()), host='127.0.0.1', port={port}, print=None)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", proc, timeout=30, what="upstream double")
    return proc, url


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_kvstream(backend_url: str, tmp: Path, env: dict[str, str], *, wait: bool = True, port: int | None = None) -> Server:
    port = port or free_port()
    log = tmp / f"kvstream-{port}.log"
    environ = os.environ | {"KVSTREAM_SERVER__PORT": str(port)} | env
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstream.cli.main", "serve", "--backend", "openai", "--backend-url", backend_url],
            cwd=tmp, env=environ, stdout=out, stderr=subprocess.STDOUT,
        )
    server = Server(f"http://127.0.0.1:{port}", port, proc, log)
    if wait:
        wait_http(server.url + "/health", proc, timeout=30, what="kvstream serve")
    return server


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def status(server: Server) -> dict:
    return httpx.get(server.url + "/status", headers=auth(), timeout=10).json()


def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send bytes on a fresh connection and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        return b"".join(chunks)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (what it sends is read)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    proc, url = start_upstream()
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def guarded(upstream, tmp_path_factory) -> Iterator[Server]:
    """A keyed KVStream with short limits (one process for the probes that share it)."""
    env = {
        "KVSTREAM_SERVER__API_KEYS": ",".join(KEYS),
        "KVSTREAM_SERVER__IDLE_TIMEOUT_S": "1",
        "KVSTREAM_SERVER__BODY_TIMEOUT_S": "1",
        "KVSTREAM_SERVER__MAX_CONNECTIONS": "40",
        "KVSTREAM_SERVER__MAX_CONCURRENT_PER_KEY": "1",
        "KVSTREAM_SERVER__MAX_MESSAGES": "64",
    }
    server = start_kvstream(upstream, tmp_path_factory.mktemp("guarded"), env)
    yield server
    stop(server.proc)


# ------------------------------------------------------------------ body bombs
def _bomb(inflated_mib: int) -> bytes:
    """A gzip body that inflates to ``inflated_mib`` MiB of zeros, in about 1 KB per MiB. After
    a full flush the compressor starts afresh, so one flushed MiB is a unit to repeat (the
    trailer's checksum is for what the compressor saw: a bomb need not be honest)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * (1 << 20)
    head = packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)
    unit = packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)
    return head + unit * (inflated_mib - 1) + packer.flush()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_gzip_bomb_is_not_inflated_before_auth_nor_past_the_limit(guarded):
    """3 GiB of zeros in 3 MB of gzip: 401 without a key (nothing inflated), 413 with one
    (inflation stops at the 4 MiB limit), /health answers throughout, and the server spends
    next to no CPU on it (aiohttp's parser used to inflate all 3 GiB, twice)."""
    bomb = _bomb(3072)
    assert len(bomb) < 4 * 1024 * 1024
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    before = cpu_seconds(guarded.proc.pid)
    with ThreadPoolExecutor(4) as pool:
        sends = [
            pool.submit(httpx.post, guarded.url + "/v1/chat/completions", content=bomb, headers=headers, timeout=60),
            pool.submit(
                httpx.post, guarded.url + "/v1/chat/completions", content=bomb, headers=headers | auth(), timeout=60
            ),
        ]
        health = [httpx.get(guarded.url + "/health", timeout=10).status_code for _ in range(20)]
        unkeyed, keyed = (f.result() for f in sends)
    spent = cpu_seconds(guarded.proc.pid) - before
    assert health == [200] * 20
    assert unkeyed.status_code == 401
    assert keyed.status_code == 413, keyed.text
    assert "limit" in keyed.json()["error"]["message"]
    # Inflating 6 GiB costs seconds of CPU on any machine; reading 6 MB and inflating 4 MiB
    # costs a few hundredths.
    assert spent < 1.0, f"the server spent {spent:.2f} s of CPU on two bombs"


def test_compressed_bodies_that_fit_work_and_others_get_a_4xx(guarded):
    ok = httpx.post(
        guarded.url + "/v1/chat/completions", content=gzip.compress(json.dumps(CHAT).encode()),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"} | auth(), timeout=10,
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"] == "Hello, world!"
    fake = httpx.post(
        guarded.url + "/v1/chat/completions", content=json.dumps(CHAT).encode(),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"} | auth(), timeout=10,
    )
    assert fake.status_code == 400 and fake.json()["error"]["code"] == "invalid_body"
    brotli = httpx.post(
        guarded.url + "/v1/chat/completions", content=b"\x0b\x02\x80hi\x03",
        headers={"Content-Encoding": "br", "Content-Type": "application/json"} | auth(), timeout=10,
    )
    assert brotli.status_code == 415


# ----------------------------------------------------------- slow and idle sockets
def test_idle_sockets_and_slow_heads_are_closed(guarded):
    idle = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(10)]
    slow = []
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", guarded.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        slow.append(sock)
    try:
        assert all(closed_by_server(s, within=5) for s in idle + slow)
    finally:
        for sock in idle + slow:
            sock.close()


def test_a_head_trickled_byte_by_byte_is_cut_off(guarded):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 100 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        started = time.monotonic()
        sent = 0
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                sent += 1
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        # The server closed before the 6 s the head needs at this rate.
        assert closed_by_server(sock, within=5)
        assert sent < len(head) or time.monotonic() - started < 6


def test_a_body_trickled_slowly_gets_408_and_the_slot_is_not_held(guarded):
    body = json.dumps(CHAT).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as sock:
        sock.sendall(head + body[:5])
        answer = b""
        try:
            for byte in body[5:]:
                time.sleep(0.3)
                sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            pass
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert status(guarded)["queue"]["running"] == 0


def test_past_the_connection_cap_new_connections_get_503_and_the_log_stays_quiet(guarded):
    held = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(40)]
    try:
        time.sleep(0.2)
        refused = raw_request(guarded.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 503"), refused[:100]
        assert b"too_many_connections" in refused
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert httpx.post(guarded.url + "/v1/chat/completions", json=CHAT, headers=auth(), timeout=10).status_code == 200
    log = guarded.log_text()
    assert "Traceback" not in log
    assert log.count("refusing new ones") <= 1


# ------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "body, headers",
    [
        (json.dumps({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}), {}),
        ('{"model": "test-model", "messages": [{"role": "user", "content": "\\ud800"}]}', {}),
        ("[" * 1100 + "]" * 1100, {}),
        (json.dumps(CHAT), {"Content-Encoding": "gzip"}),
    ],
    ids=["text-part-not-string", "lone-surrogate", "nested-1100-deep", "not-gzip"],
)
def test_malformed_input_never_gets_a_500(guarded, body, headers):
    """In front of an OpenAI runtime the body is the runtime's to judge (this double takes
    a numeric text part); what KVStream must never do is fail on it itself."""
    resp = httpx.post(
        guarded.url + "/v1/chat/completions", content=body.encode("utf-8", "surrogatepass"),
        headers={"Content-Type": "application/json"} | auth() | headers, timeout=10,
    )
    assert resp.status_code < 500, resp.text
    assert "Traceback" not in guarded.log_text()


def test_a_non_utf8_authorization_header_is_a_401(guarded):
    answer = raw_request(
        guarded.port, b"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:100]


def test_a_client_request_id_that_could_garble_logs_is_replaced(guarded):
    plain = httpx.get(guarded.url + "/status", headers=auth() | {"X-Request-Id": "trace-42:a/b"}, timeout=10)
    assert plain.headers["X-Request-Id"] == "trace-42:a/b"
    for hostile in (b"a" * 200, b"x y", b'id"quoted', "é-unicode".encode()):
        resp = httpx.get(guarded.url + "/status", headers=auth() | {"X-Request-Id": hostile}, timeout=10)
        assert resp.headers["X-Request-Id"].startswith("req-"), hostile


# ------------------------------------------------------------------------ warm
def test_warm_obeys_the_per_key_cap_and_the_message_limit_and_is_counted(guarded):
    warm = {"messages": [{"role": "system", "content": "You are a careful assistant."}]}
    with ThreadPoolExecutor(10) as pool:
        codes = list(pool.map(
            lambda _: httpx.post(guarded.url + "/v1/warm", json=warm, headers=auth(KEYS[1]), timeout=10).status_code,
            range(10),
        ))
    assert set(codes) <= {200, 429} and 200 in codes
    many = {"messages": [{"role": "user", "content": "x"}] * 65}
    resp = httpx.post(guarded.url + "/v1/warm", json=many, headers=auth(), timeout=10)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_many_messages"
    metrics = httpx.get(guarded.url + "/metrics", headers=auth(), timeout=10).text
    assert 'kvstream_requests_total{code="413",route="warm"}' in metrics
    assert 'kvstream_requests_total{code="200",route="warm"}' in metrics


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/warm", "/api/chat"])
def test_too_many_messages_are_refused_before_each_is_read(guarded, path):
    """Past ``server.max_messages`` every route that takes messages answers the 413 on their
    count, before validating or translating each (tens of thousands of them held the event
    loop a quarter of a second for a refusal): a bad message among them does not make it a 400.
    (In front of an OpenAI runtime: the chat is forwarded, the others translated; the routes
    KVStream validates in front of Ollama: tests/test_api_fronts.py.)"""
    messages = [{"role": "user", "content": "x"}] * 64 + [{"role": "nobody", "content": 7}]
    body = {"model": "test-model", "max_tokens": 4, "messages": messages}
    resp = httpx.post(guarded.url + path, json=body, headers=auth(), timeout=10)
    assert resp.status_code == 413, resp.text
    answer = resp.json()
    if path == "/api/chat":  # Ollama's error shape
        assert "too many messages" in answer["error"]
    else:
        assert answer["error"]["code"] == "too_many_messages"
    # Within the limit the bad message is what is judged: by KVStream where it translates the
    # body, by the runtime where the body is forwarded as sent (this double takes any role).
    within = {"model": "test-model", "max_tokens": 4, "messages": messages[:63] + messages[-1:]}
    forwarded = path == "/v1/chat/completions"
    assert httpx.post(guarded.url + path, json=within, headers=auth(), timeout=10).status_code == (200 if forwarded else 400)


# ------------------------------------------------------------- tenant isolation
def test_a_tenant_sees_only_its_own_cached_prefixes(guarded):
    system = "You answer questions about the private roadmap of tenant A. " * 12
    body = {"model": "test-model", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}
    first = httpx.post(guarded.url + "/v1/chat/completions", json=body, headers=auth(KEYS[0]), timeout=10)
    again = httpx.post(guarded.url + "/v1/chat/completions", json=body, headers=auth(KEYS[0]), timeout=10)
    probe = httpx.post(guarded.url + "/v1/chat/completions", json=body, headers=auth(KEYS[1]), timeout=10)
    assert first.headers["X-KVStream-Prefix-Hit-Tokens"] == "0"
    assert int(again.headers["X-KVStream-Prefix-Hit-Tokens"]) > 0  # the owner's own hit
    assert probe.headers["X-KVStream-Prefix-Hit-Tokens"] == "0"  # another key learns nothing
    warm = httpx.post(guarded.url + "/v1/warm", json={"messages": body["messages"]}, headers=auth(KEYS[1]), timeout=10)
    assert warm.status_code == 200, warm.text
    # Tenant B's own probe above cached its copy: B now hits its own, never A's.
    assert warm.json()["cached_tokens"] > 0


# ----------------------------------------------------------- stalled readers
def test_a_client_that_never_reads_its_stream_loses_its_slot(tmp_path):
    """One batch slot; a client asks for a 48 MB stream and reads nothing. The write
    timeout drops it and the next client is served (before: 503 after the queue timeout)."""
    up, url = start_upstream("Script(tokens=['x' * 16384] * 3000)")
    server = start_kvstream(url, tmp_path, {
        "KVSTREAM_SCHEDULER__MAX_BATCH_SIZE": "1",
        "KVSTREAM_SCHEDULER__QUEUE_TIMEOUT_S": "20",
        "KVSTREAM_SERVER__WRITE_TIMEOUT_S": "1",
    })
    try:
        body = json.dumps({**CHAT, "stream": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        time.sleep(0.5)  # admitted, streaming into a socket nobody reads
        # Served: with the stalled client holding the only slot it would wait out the
        # 20 s queue timeout and get 503.
        resp = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=30)
        assert resp.status_code == 200, resp.text
        sock.close()
        assert "read nothing for 1s" in server.log_text()
    finally:
        stop(server.proc, up)


# ------------------------------------------------------------ upstream deadline
def test_the_request_deadline_cuts_an_upstream_that_trickles(tmp_path):
    """A token every 0.5 s for 20 s: the read timeout (2 s) never fires, the deadline (2 s)
    does, and the client's stream ends with an error event rather than hanging on."""
    up, url = start_upstream("Script(tokens=['t'] * 40, delay_s=0.5)")
    server = start_kvstream(url, tmp_path, {
        "KVSTREAM_BACKEND__REQUEST_TIMEOUT_S": "2",
        "KVSTREAM_BACKEND__READ_TIMEOUT_S": "2",
    })
    try:
        text = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30).text
        assert "request deadline" in text, text[-300:]  # cut by the deadline, not run to its end
        assert text.count("data: ") < 40  # the 40 tokens did not all arrive
        assert httpx.get(server.url + "/status", timeout=5).json()["queue"]["running"] == 0
    finally:
        stop(server.proc, up)


# ----------------------------------------------------------------- credentials
def test_backend_url_credentials_never_show(tmp_path, refused_port):
    dead = refused_port()
    server = start_kvstream(f"http://admin:hunter2secret@127.0.0.1:{dead}", tmp_path, {})
    try:
        seen = [
            httpx.get(server.url + "/status", timeout=5).text,
            httpx.get(server.url + "/ready", timeout=5).text,
            httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10).text,
            httpx.get(server.url + "/props", timeout=10).text,
        ]
        for text in seen:
            assert "hunter2secret" not in text and "admin:" not in text
        assert f"127.0.0.1:{dead}" in seen[0]  # the URL itself is shown
    finally:
        stop(server.proc)
    assert "hunter2secret" not in server.log_text()


def test_a_backend_url_that_is_kvstream_itself_is_refused_at_start(tmp_path):
    port = free_port()
    server = start_kvstream(f"http://localhost:{port}/v1", tmp_path, {}, wait=False, port=port)
    assert server.proc.wait(timeout=30) == 2
    assert f"the backend URL http://localhost:{port}/v1 is KVStream's own address" in server.log_text()


def test_two_kvstreams_pointed_at_each_other_answer_508_at_once(tmp_path):
    """A -> B -> A: the request comes back to A carrying A's name in Via and is refused there;
    without that, every hop opened another connection until the listeners' caps (seconds of
    hanging, then 503s for everyone). Managed and passed-through routes alike."""
    port_a, port_b = free_port(), free_port()
    assert port_a != port_b
    a = start_kvstream(f"http://127.0.0.1:{port_b}", tmp_path, {}, port=port_a)
    b = start_kvstream(f"http://127.0.0.1:{port_a}", tmp_path, {}, port=port_b)
    try:
        for method, path, body in (("POST", "/v1/chat/completions", CHAT), ("GET", "/props", None),
                                   ("POST", "/v1/chat/completions", CHAT | {"stream": True})):
            answer = httpx.request(method, a.url + path, json=body, timeout=10)  # before: a read timeout
            assert answer.status_code == 508, (path, answer.text)
            if path != "/props":  # the managed route answers in OpenAI's shape
                assert answer.json()["error"]["code"] == "proxy_loop"
            assert "leads to KVStream itself" in answer.text
        for server in (a, b):
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            queue = httpx.get(server.url + "/status", timeout=5).json()["queue"]
            assert queue["running"] == 0 and queue["waiting"] == 0
    finally:
        stop(a.proc, b.proc)
    assert "leads to KVStream itself" in a.log_text()


def test_url_credentials_reach_the_runtime_as_basic_auth(upstream, tmp_path):
    port = free_port()
    code = (
        "from aiohttp import web\n"
        "async def models(request):\n"
        "    return web.json_response({'object': 'list', 'data': [{'id': 'm', 'object': 'model', 'created': 1,"
        " 'owned_by': request.headers.get('Authorization', 'none')}]})\n"
        "app = web.Application(); app.router.add_get('/v1/models', models)\n"
        f"web.run_app(app, host='127.0.0.1', port={port}, print=None)\n"
    )
    echo = subprocess.Popen([sys.executable, "-c", code])
    wait_http(f"http://127.0.0.1:{port}/v1/models", echo, timeout=30, what="echo server")
    server = start_kvstream(f"http://ad%40min:p%3Ass@127.0.0.1:{port}", tmp_path, {})
    try:
        owner = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["owned_by"]
        import base64

        assert owner == "Basic " + base64.b64encode(b"ad@min:p:ss").decode()
    finally:
        stop(server.proc, echo)


def test_url_credentials_and_an_api_key_together_are_a_config_error(tmp_path):
    server = start_kvstream(
        "http://user:pw@127.0.0.1:9", tmp_path, {"KVSTREAM_BACKEND__API_KEY": "sk-upstream"}, wait=False
    )
    assert server.proc.wait(timeout=30) == 2
    log = server.log_text()
    assert "only one Authorization header" in log and "Traceback" not in log and "pw" not in log.replace("only", "")
