"""The command line as users type it: config show, config errors, unknown backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def kvstream(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstream.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=60)


def test_config_show_names_the_source_of_each_value(tmp_path):
    (tmp_path / "kvstream.yaml").write_text("scheduler:\n  max_batch_size: 3\n")
    out = kvstream("config", "show", "--json", env={"KVSTREAM_BACKEND": "ollama", "KVSTREAM_SERVER__API_KEYS": "secret-key"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["backend.type"] == {"value": "ollama", "source": "KVSTREAM_BACKEND"}
    assert shown["scheduler.max_batch_size"]["value"] == "3" and shown["scheduler.max_batch_size"]["source"].endswith("kvstream.yaml")
    assert shown["server.port"] == {"value": "8080", "source": "default"}
    assert "secret-key" not in out.stdout


def test_an_invalid_value_fails_at_start_with_one_line(tmp_path):
    out = kvstream("serve", env={"KVSTREAM_MEMORY__BLOCK_SIZE": "12"}, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "config error: invalid setting memory.block_size (from KVSTREAM_MEMORY__BLOCK_SIZE): Input should be 8, 16 or 32"
    ]


def test_an_unknown_backend_is_refused_with_the_known_names(tmp_path):
    out = kvstream("serve", "--backend", "nope", cwd=tmp_path)
    assert out.returncode == 2
    assert "unknown backend 'nope'" in out.stderr and "ollama" in out.stderr and "Traceback" not in out.stderr


def test_llamacpp_without_url_or_model_file_says_what_to_give(tmp_path):
    out = kvstream("serve", "--backend", "llamacpp", "--model", str(tmp_path / "missing.gguf"), cwd=tmp_path)
    assert out.returncode == 2 and "--backend-url" in out.stderr and "Traceback" not in out.stderr


def test_flags_that_would_do_nothing_are_refused_with_one_line(tmp_path):
    """A flag of another backend, or a streaming flag without --awq-streaming, given on the
    command line: refused at start, naming the flag, rather than silently ignored."""
    cases = [
        (["--backend", "llamacpp", "--backend-url", "http://127.0.0.1:9", "--dtype", "float16"], "--dtype is for --backend hf; the llamacpp backend would ignore it"),
        (["--backend", "ollama", "--attention-backend", "flex"], "--attention-backend is for --backend hf; the ollama backend would ignore it"),
        (["--backend", "ollama", "--staging", "copy"], "--staging is for --backend hf; the ollama backend would ignore it"),
        (["--backend", "ollama", "--chat-template", "t.jinja"], "--chat-template is for --backend hf or llamacpp; the ollama backend would ignore it"),
        (["--backend", "hf", "--slot-save-path", str(tmp_path)], "--slot-save-path is for --backend llamacpp; the hf backend would ignore it"),
        (["--backend", "hf", "--keep-first-k", "1"], "--keep-first-k needs --awq-streaming (awq.streaming); without it the flag would be ignored"),
        # auto may pick hf: only the streaming rule applies
        (["--staging", "copy"], "--staging needs --awq-streaming (awq.streaming); without it the flag would be ignored"),
    ]
    for args, message in cases:
        out = kvstream("serve", *args, "--port", "0", cwd=tmp_path)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip().splitlines() == [f"config error: {message}"], (args, out.stderr)


def test_a_config_file_may_carry_settings_another_backend_would_use(tmp_path):
    """A file describes every setting whichever backend runs: hf and streaming values in it
    do not stop a proxy from starting (here it gets as far as refusing the missing model file)."""
    (tmp_path / "kvstream.yaml").write_text("memory:\n  dtype: float16\nawq:\n  staging: copy\n  keep_first_k: 1\n")
    out = kvstream("serve", "--backend", "llamacpp", "--model", str(tmp_path / "missing.gguf"), cwd=tmp_path)
    assert out.returncode == 2 and "--backend-url" in out.stderr and "would ignore" not in out.stderr


def test_a_backend_at_kvstreams_own_address_is_found_in_every_place_a_url_is_configured():
    from kvstream.cli.serve import own_address_among_backends
    from kvstream.config import UpstreamEntry
    from tests.conftest import make_settings

    def own(**sections):
        return own_address_among_backends(make_settings(**sections))

    assert own(server={"port": 9100}, backend={"type": "openai", "base_url": "http://[::1]:9100/v1"}) == "http://[::1]:9100/v1"
    assert own(server={"port": 11434}, backend={"type": "ollama"}) == "http://127.0.0.1:11434"  # the type's default URL
    assert own(server={"port": 9100}, backend={"type": "openai", "replicas": ["http://127.0.0.1:9101", "http://localhost:9100"]}) \
        == "http://localhost:9100"
    fleet = make_settings(server={"port": 80}).model_copy(update={"backends": [UpstreamEntry(type="ollama", url="http://0.0.0.0")]})
    assert own_address_among_backends(fleet) == "http://0.0.0.0"
    assert own(server={"host": "10.1.2.3", "port": 9100}, backend={"type": "openai", "base_url": "http://10.1.2.3:9100"})
    # Another port, another machine, the managed llama-server (no URL): not KVStream.
    assert own(server={"port": 9100}, backend={"type": "openai", "base_url": "http://127.0.0.1:9101"}) is None
    assert own(server={"port": 9100}, backend={"type": "openai", "base_url": "http://gpu-box:9100"}) is None
    assert own(server={"port": 9100}, backend={"type": "llamacpp"}) is None


def test_a_port_in_use_says_so_and_how_to_move(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = kvstream("serve", "--backend", "openai", "--backend-url", "http://127.0.0.1:9", "--port", str(port), cwd=tmp_path)
    assert out.returncode == 1
    assert f"something already listens on port {port}" in out.stderr and "--port N" in out.stderr
    assert "Traceback" not in out.stderr
