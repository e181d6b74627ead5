"""Deployment files: the Grafana dashboard uses only exported metrics, provisioning is valid,
the compose file validates for both profiles, the Dockerfile is slim, non-root and healthy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvstream.backends import OpenAICompatibleBackend
from tests.conftest import REQUIRE_REAL

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "grafana"


async def exported_names(start_upstream, start_proxy) -> set[str]:
    url, _ = await start_upstream()
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/metrics") as resp:
            text = await resp.text()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


async def test_every_dashboard_query_uses_an_exported_metric(start_upstream, start_proxy):
    names = await exported_names(start_upstream, start_proxy)
    dashboard = json.loads((GRAFANA / "dashboards/kvstream.json").read_text())
    assert dashboard["panels"], "empty dashboard"
    used = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"\bkvstream_[a-z0-9_]+", target["expr"]):
                assert name in names, f"panel {panel['title']!r} uses {name}, which KVStream does not export"
                used.add(name)
    assert len(used) >= 20


def test_provisioning_files_are_valid_and_point_at_files_that_exist():
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"
    dashboards = yaml.safe_load((GRAFANA / "provisioning/dashboards/kvstream.yml").read_text())
    path = dashboards["providers"][0]["options"]["path"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = {m.split(":")[1]: m.split(":")[0] for m in compose["services"]["grafana"]["volumes"]}
    assert (ROOT / mounts[path]).is_dir() and list((ROOT / mounts[path]).glob("*.json"))
    assert (ROOT / mounts["/etc/grafana/provisioning"]).is_dir()
    prometheus = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == ["kvstream:8080"]


def compose_binary() -> str:
    found = shutil.which("docker-compose")
    if not found:
        if REQUIRE_REAL:
            pytest.fail("docker-compose is not installed (apt-get install docker-compose)")
        pytest.skip("docker-compose is not installed")
    return found


@pytest.mark.parametrize("profile", [None, "metrics"])
def test_compose_file_validates(profile):
    binary = compose_binary()
    args = [binary, "-f", str(ROOT / "docker-compose.yml")]
    if profile:
        args += ["--profile", profile]
    env = {**os.environ, "KVSTREAM_GRAFANA_PASSWORD": "test-password"}
    result = subprocess.run(args + ["config"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    # Which services `up` starts: those without profiles, plus those of the chosen profile.
    started = {name for name, svc in config["services"].items() if not svc.get("profiles") or profile in svc["profiles"]}
    expected = {"ollama", "ollama-pull", "kvstream"} | ({"prometheus", "grafana"} if profile else set())
    assert started == expected
    kv = config["services"]["kvstream"]
    assert kv["environment"]["KVSTREAM_BACKEND"] == "ollama"
    for port in kv["ports"]:  # published on the host's loopback only
        assert (port.get("host_ip") if isinstance(port, dict) else port.split(":")[0]) == "127.0.0.1", port


def test_compose_backend_is_switchable_by_environment():
    binary = compose_binary()
    env = {**os.environ, "KVSTREAM_BACKEND": "llamacpp", "KVSTREAM_BACKEND_URL": "http://host.docker.internal:9931"}
    out = subprocess.run([binary, "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True, env=env, timeout=60)
    kv = yaml.safe_load(out.stdout)["services"]["kvstream"]["environment"]
    assert kv["KVSTREAM_BACKEND"] == "llamacpp" and kv["KVSTREAM_BACKEND_URL"] == "http://host.docker.internal:9931"


def test_dockerfile_is_slim_non_root_with_healthcheck_and_no_secrets():
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    base = next(line for line in lines if line.startswith("FROM "))
    assert re.fullmatch(r"FROM python:3\.\d+-slim", base)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert any(line.startswith("HEALTHCHECK ") and "/health" in line for line in text.replace("\\\n", " ").splitlines())
    assert not re.search(r"(?i)(api_?key|password|secret|token)\s*=\s*\S+", text)
    assert not any(line.startswith("ADD ") and "http" in line for line in lines)
    assert "KVSTREAM_SERVER__HOST=0.0.0.0" in text  # reachable through the published port
