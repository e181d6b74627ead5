"""Configuration precedence (CLI > env > YAML > defaults), provenance, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvstream.config import ConfigError, Settings, describe, load_settings

REPO = Path(__file__).resolve().parent.parent


def test_defaults(tmp_path):
    loaded = load_settings(environ={}, cwd=tmp_path)
    s = loaded.settings
    assert s.server.host == "127.0.0.1" and s.server.port == 8080
    assert s.memory.block_size == 16 and s.memory.num_gpu_blocks == "auto"
    assert set(loaded.sources.values()) == {"default"}


def test_precedence_cli_over_env_over_yaml_over_defaults(tmp_path):
    (tmp_path / "kvstream.yaml").write_text(
        "memory:\n  num_gpu_blocks: 100\n  num_cpu_blocks: 7\nscheduler:\n  max_batch_size: 3\nserver:\n  port: 9000\n"
    )
    env = {"KVSTREAM_MEMORY__NUM_GPU_BLOCKS": "4096", "KVSTREAM_SCHEDULER__MAX_BATCH_SIZE": "5"}
    loaded = load_settings({"scheduler": {"max_batch_size": 9}}, environ=env, cwd=tmp_path)
    s = loaded.settings
    assert s.scheduler.max_batch_size == 9 and loaded.sources["scheduler.max_batch_size"] == "cli"
    assert s.memory.num_gpu_blocks == 4096 and loaded.sources["memory.num_gpu_blocks"] == "KVSTREAM_MEMORY__NUM_GPU_BLOCKS"
    assert s.memory.num_cpu_blocks == 7 and loaded.sources["memory.num_cpu_blocks"].endswith("kvstream.yaml")
    assert s.server.port == 9000
    assert s.server.host == "127.0.0.1" and loaded.sources["server.host"] == "default"


def test_short_env_forms_and_long_form_wins(tmp_path):
    env = {"KVSTREAM_BACKEND": "ollama", "KVSTREAM_BACKEND_URL": "http://box:11434"}
    s = load_settings(environ=env, cwd=tmp_path).settings
    assert s.backend.type == "ollama" and s.backend.base_url == "http://box:11434"
    env["KVSTREAM_BACKEND__TYPE"] = "lmstudio"
    assert load_settings(environ=env, cwd=tmp_path).settings.backend.type == "lmstudio"


def test_explicit_config_path(tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text("prefix_cache:\n  enabled: false\n")
    assert load_settings(config_path=path, environ={}, cwd=tmp_path).settings.prefix_cache.enabled is False
    with pytest.raises(ConfigError, match="no such file"):
        load_settings(config_path=tmp_path / "missing.yaml", environ={})


@pytest.mark.parametrize(
    "env, yaml_text, message",
    [
        ({"KVSTREAM_MEMORY__BLOCK_SIZE": "12"}, None, "memory.block_size (from KVSTREAM_MEMORY__BLOCK_SIZE)"),
        ({"KVSTREAM_SCHEDULER__PREEMPTION_POLICY": "kill"}, None, "scheduler.preemption_policy"),
        ({"KVSTREAM_MEMORY__NUM_GPU_BLOCKS": "0"}, None, "memory.num_gpu_blocks"),
        ({"KVSTREAM_BACKEND__SEED": "-2"}, None, "backend.seed"),
        ({"KVSTREAM_SCHEDULER__LPM_WINDOW": "0"}, None, "scheduler.lpm_window"),
        ({"KVSTREAM_BACKEND__SEED": str(2**32)}, None, "backend.seed"),
        ({"KVSTREAM_SERVER__PORTT": "1"}, None, "unknown setting server.portt"),
        ({}, "memory:\n  block_size: 64\n", "memory.block_size (from"),
        ({}, "memroy:\n  block_size: 16\n", "unknown section 'memroy'"),
        ({}, "server: [1, 2\n", "not valid YAML"),
        ({"KVSTREAM_BACKEND_URL": "ftp://127.0.0.1:21"}, None,
         "backend.base_url (from KVSTREAM_BACKEND_URL): 'ftp://127.0.0.1:21' is not an http(s) URL of a runtime"),
        ({"KVSTREAM_BACKEND__REPLICAS": "http://127.0.0.1:9931,http://127.0.0.1:99999"}, None,
         "backend.replicas (from KVSTREAM_BACKEND__REPLICAS): 'http://127.0.0.1:99999' has a port that is not a number"),
        ({}, "backends:\n  - {type: ollama, url: 'http://'}\n", "backends[0].url (from"),
    ],
)
def test_invalid_values_fail_with_one_line_naming_the_key(tmp_path, env, yaml_text, message):
    if yaml_text is not None:
        (tmp_path / "kvstream.yaml").write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_settings(environ=env, cwd=tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_api_keys_from_env_are_split_and_never_shown(tmp_path):
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# comment\nk-file\n")
    env = {"KVSTREAM_SERVER__API_KEYS": "k1, k2", "KVSTREAM_SERVER__API_KEYS_FILE": str(keys_file)}
    loaded = load_settings(environ=env, cwd=tmp_path)
    assert loaded.settings.accepted_keys() == ["k1", "k2", "k-file"]
    shown = " ".join(value for _, value, _ in describe(loaded))
    assert "k1" not in shown and "k2" not in shown and "(2 set, hidden)" in shown


@pytest.mark.parametrize("form", ['["a","b"]', ' [ "a", "b" ] ', "a,b"])
def test_api_keys_in_the_json_list_form_are_the_same_keys(tmp_path, form):
    """pydantic-settings' own form for lists must not turn into the keys '["a"' and '"b"]'."""
    loaded = load_settings(environ={"KVSTREAM_SERVER__API_KEYS": form}, cwd=tmp_path)
    assert loaded.settings.accepted_keys() == ["a", "b"]


@pytest.mark.parametrize("form", ['["a", 3]', '["a", "b"'])
def test_a_broken_json_list_of_keys_is_a_config_error(tmp_path, form):
    with pytest.raises(ConfigError, match="server.api_keys"):
        load_settings(environ={"KVSTREAM_SERVER__API_KEYS": form}, cwd=tmp_path)


def test_repo_kvstream_yaml_lists_every_key_with_its_default():
    """The documented file is the defaults, key for key (docs as tests)."""
    data = yaml.safe_load((REPO / "kvstream.yaml").read_text())
    defaults = Settings().model_dump(mode="json")
    for section, values in defaults.items():
        if isinstance(values, list):  # backends: an empty list by default, entries shown in comments
            assert data[section] == values, section
            continue
        assert set(data[section]) == set(values), section
        for key, value in values.items():
            assert data[section][key] == value, f"{section}.{key}"
    text = (REPO / "kvstream.yaml").read_text()
    for section, values in defaults.items():
        for key in values if isinstance(values, dict) else ():
            line = next(line for line in text.splitlines() if line.startswith(f"  {key}:"))
            assert "#" in line, f"{section}.{key} has no comment"


def test_max_batch_size_is_auto_by_default_and_takes_a_number(tmp_path):
    """auto means 8 in front of a runtime (the in-process engine sizes its own from the pool);
    a number is taken as it is, zero is refused naming the key."""
    assert Settings().scheduler.max_batch_size == "auto" and Settings().scheduler.remote_batch_size() == 8
    loaded = load_settings({}, environ={"KVSTREAM_SCHEDULER__MAX_BATCH_SIZE": "12"}, cwd=tmp_path)
    assert loaded.settings.scheduler.remote_batch_size() == 12
    (tmp_path / "kvstream.yaml").write_text("scheduler:\n  max_batch_size: auto\n")
    assert load_settings({}, environ={}, cwd=tmp_path).settings.scheduler.max_batch_size == "auto"
    with pytest.raises(ConfigError, match="scheduler.max_batch_size"):
        load_settings({"scheduler": {"max_batch_size": 0}}, environ={}, cwd=tmp_path)


def test_a_server_seed_of_minus_one_is_llama_servers_random(tmp_path):
    """``--seed -1`` means a random seed at llama-server: here too, the same as none."""
    assert load_settings(environ={"KVSTREAM_BACKEND__SEED": "-1"}, cwd=tmp_path).settings.backend.seed is None
    assert load_settings(environ={"KVSTREAM_BACKEND__SEED": "42"}, cwd=tmp_path).settings.backend.seed == 42


def test_the_lpm_window_set_reaches_the_scheduler_in_front_of_a_runtime(tmp_path):
    from kvstream.backends.openai_compat import OpenAICompatibleBackend
    from kvstream.engine import KVStreamEngine

    settings = load_settings(environ={"KVSTREAM_SCHEDULER__LPM_WINDOW": "5"}, cwd=tmp_path).settings
    engine = KVStreamEngine(OpenAICompatibleBackend("http://127.0.0.1:9", "m"), settings)
    assert engine.scheduler.config.policy == "lpm" and engine.scheduler.config.lpm_window == 5


def test_a_runtime_url_without_a_scheme_is_http(tmp_path):
    """``127.0.0.1:11434`` as curl and OLLAMA_HOST read it; before, every request failed with
    "the runtime sent a malformed answer (NonHttpUrlClientError)"."""
    (tmp_path / "kvstream.yaml").write_text("backends:\n  - {type: ollama, url: 'gpu-box:11434'}\n")
    loaded = load_settings(environ={"KVSTREAM_BACKEND_URL": " localhost:8080/v1 ", "KVSTREAM_BACKEND__REPLICAS": "127.0.0.1:9931"},
                           cwd=tmp_path).settings
    assert loaded.backend.base_url == "http://localhost:8080/v1"
    assert loaded.backend.replicas == ["http://127.0.0.1:9931"]
    assert loaded.backends[0].url == "http://gpu-box:11434"
