"""The architecture as tests: no import cycles, layers import only downward, and a proxy-only
install (no torch, no transformers) imports the package and its CLI.

Imports are read from the source with ``ast``, at module level and inside functions alike
(a function-level import closes a cycle as surely as a top-level one, only later); imports
under ``if TYPE_CHECKING:`` are annotations, not imports, and are left out. A package's
``__init__`` importing its own submodules is not an edge back (that is how packages
re-export), but any other import of a package is an edge to its ``__init__``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvstream"

# Lowest first; a module may import its own layer and the ones below it.
LAYERS: list[tuple[str, ...]] = [
    ("kvstream", "kvstream.types", "kvstream.config", "kvstream.jsonfast", "kvstream.embedded"),
    ("kvstream.kv", "kvstream.scheduler"),  # the mechanism
    ("kvstream.backends", "kvstream.hf"),  # remote runtimes; the in-process engine
    ("kvstream.engine",),
    ("kvstream.metrics",),  # observes the engine; nobody below imports it
    ("kvstream.api",),
    ("kvstream.bench", "kvstream.cli"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped |= {id(n) for n in ast.walk(child)}
    return skipped


def imports_of(module: str) -> set[str]:
    """The kvstream modules that ``module`` imports, resolved to existing modules."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_nodes(tree)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if not name or name == module:
                continue
            if is_package and name.startswith(module + "."):
                continue  # a package re-exporting its own submodule
            found.add(name)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def test_graph_sees_the_package():
    assert "kvstream.engine.core" in GRAPH and "kvstream.kv.block_manager" in GRAPH
    assert "kvstream.kv.block_pool" in GRAPH["kvstream.kv.block_manager"]
    # Function-level imports are edges too.
    assert "kvstream.hf.loader" in GRAPH["kvstream.hf.backend"]


def test_no_import_cycles():
    # Tarjan's strongly connected components: any component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_layers_import_only_downward():
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_mechanism_imports_only_itself_and_the_vocabulary():
    allowed = ("kvstream.kv", "kvstream.scheduler", "kvstream.types")
    for module, targets in GRAPH.items():
        if module.startswith(("kvstream.kv", "kvstream.scheduler")):
            foreign = {t for t in targets if not t.startswith(allowed)}
            assert not foreign, f"{module} imports {foreign}"


def test_remote_backends_never_import_the_in_process_engine():
    for module, targets in GRAPH.items():
        if module.startswith("kvstream.backends"):
            assert not {t for t in targets if t.startswith("kvstream.hf")}, module


def _run_without(modules: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where importing ``modules`` fails, as on a
    proxy-only install."""
    block = f"import sys\nfor m in {modules!r}: sys.modules[m] = None\n"
    return subprocess.run([sys.executable, "-c", block + code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_package_and_cli_import_without_torch():
    code = (
        "import kvstream, kvstream.cli.main, kvstream.cli.serve, kvstream.api.server, kvstream.backends, "
        "kvstream.hf, kvstream.hf.backend\n"
        "from kvstream import KVStreamEngine\n"
        "print('imported')\n"
    )
    result = _run_without(("torch", "transformers", "safetensors"), code)
    assert result.returncode == 0 and "imported" in result.stdout, result.stderr


def test_importing_kvstream_does_not_load_torch():
    code = (
        "import sys, kvstream, kvstream.cli.main, kvstream.api.app, kvstream.backends, kvstream.hf\n"
        "from kvstream.cli.serve import build_backend\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_serve_hf_without_torch_says_which_extra_in_one_line():
    code = (
        "import sys\nsys.argv = ['kvstream', 'serve', '--backend', 'hf', '--port', '0']\n"
        "from kvstream.cli.main import main\nmain()\n"
    )
    result = _run_without(("torch", "transformers"), code)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "pip install 'kvstream[hf]'" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.count(".") >= 1))
def test_every_public_module_has_a_docstring(module: str):
    tree = ast.parse(MODULES[module].read_text())
    assert ast.get_docstring(tree), f"{module} has no module docstring"
