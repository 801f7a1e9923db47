"""The map stays true: docs/architecture.md lists every module with its layer, imports only point down, only the
CLI and its views print, llama_cpp is imported only behind the wall, and the README's command table matches the
commands that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from localspec.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "localspec"
LAYERS = ["base", "llama", "logic", "engine", "session", "library", "server", "ui", "cli"]  # bottom to top
LLAMA_WALL = ("localspec/llama/", "localspec/cli/app.py")  # the wall and the entry point's import guard
PRINTING_ALLOWED = ("localspec/cli/", "localspec/ui/")


def _documented() -> dict[str, str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- modules:start -->")[1].split("<!-- modules:end -->")[0]
    return dict(re.findall(r"^\| `(localspec/\S+\.py)` \| (\w+) \|", block, flags=re.M))


def _modules() -> dict[str, ast.Module]:
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def test_every_module_is_on_the_map_with_a_known_layer() -> None:
    documented = _documented()
    present = set(_modules())
    assert sorted(present - set(documented)) == [], "add these modules to docs/architecture.md"
    assert sorted(set(documented) - present) == [], "docs/architecture.md lists modules that no longer exist"
    unknown = {path: layer for path, layer in documented.items() if layer not in LAYERS}
    assert unknown == {}, f"layers must be one of {LAYERS}"


def _imports(tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            out += [f"{node.module}.{alias.name}" for alias in node.names]
    return out


def test_imports_point_down_the_layers() -> None:
    documented = _documented()
    layer_of = {_module_name(path): LAYERS.index(layer) for path, layer in documented.items()}
    wrong = []
    for path, tree in _modules().items():
        mine = LAYERS.index(documented[path])
        for name in _imports(tree):
            if name in layer_of and name != "localspec" and layer_of[name] > mine:
                wrong.append(f"{path} ({documented[path]}) imports {name} ({LAYERS[layer_of[name]]})")
    assert wrong == []


def _import_graph() -> dict[str, set[str]]:
    """Each module's imports of other localspec modules, wherever they sit (a function's body included: an import
    hidden inside a function is still a cycle). `from a import b` names a.b when b is a module, else a."""
    modules = {_module_name(path): tree for path, tree in _modules().items()}
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a closed path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles_even_within_a_layer() -> None:
    """A cycle hides in a function-level import until the day it breaks an import order; one module both import
    is the way out (as server/handling.py is for app.py and llama_routes.py)."""
    assert import_cycles(_import_graph()) == []


def test_the_cycle_check_finds_a_hidden_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"x": {"y"}, "y": {"x"}}) == [["x", "y"]]
    hidden = ast.parse("def f():\n    from localspec.server.app import create_app\n")
    assert "localspec.server.app" in _imports(hidden)


def test_llama_cpp_is_imported_only_behind_the_wall() -> None:
    offenders = [path for path, tree in _modules().items()
                 if not path.startswith(LLAMA_WALL) and any(n.split(".")[0] == "llama_cpp" for n in _imports(tree))]
    assert offenders == []


def test_only_the_cli_and_its_views_print() -> None:
    offenders = []
    for path, tree in _modules().items():
        if path.startswith(PRINTING_ALLOWED):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Name) and f.id == "print") or (
                        isinstance(f, ast.Attribute) and f.attr == "write" and isinstance(f.value, ast.Attribute)
                        and f.value.attr in ("stdout", "stderr")):
                    offenders.append(f"{path}:{node.lineno}")
    assert offenders == []


def test_the_package_imports_without_llama_cpp() -> None:
    """Config, registry and header parsing must not need libllama (the GPU harness writes models before the build)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['llama_cpp'] = None\n"
            "import localspec, localspec.config, localspec.registry, localspec.gguf_header, localspec.compat\n"
            "localspec.config.load_preset()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


# -- the CLI surface -------------------------------------------------------------------------------------------------

COMMANDS = sorted(c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and command in result.output


def _readme_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `localspec ([^`]*)` \|", table, flags=re.M)


def test_readme_command_table_matches_the_commands() -> None:
    rows = _readme_rows()
    assert {row.split()[0] for row in rows} == set(COMMANDS)
    for row in rows:
        command, *words = row.split()
        help_text = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        for flag in (w.strip("[]") for w in words if w.strip("[]").startswith("--")):
            assert flag in help_text, f"README shows `localspec {command} {flag}`, which --help does not list"
