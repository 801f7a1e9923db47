"""The map stays true: docs/architecture.md lists every module with its layer, imports only point down, only the
CLI and its views print, llama_cpp is imported only behind the wall, and the README's command table matches the
commands that exist."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest
from helpers_fake import FakeModel
from typer.testing import CliRunner

from localspec.cli.app import app
from localspec.config import DRAFTER_TABLE, DrafterFacts

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
            "import localspec, localspec.config, localspec.models.registry, localspec.models.gguf_header, "
            "localspec.models.compat\n"
            "localspec.config.load_preset()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def _event_names() -> set[str]:
    """What localspec/rounds/events.py defines at its top level (its classes, functions and constants)."""
    names = set()
    for node in ast.parse((PACKAGE / "rounds" / "events.py").read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def events_from_elsewhere(trees: dict[str, ast.Module], events: set[str]) -> list[str]:
    """Imports of an event's name from anywhere but localspec.rounds.events
    (`from localspec.rounds.engine import DoneEvent`)."""
    return [f"{path}:{node.lineno} imports {alias.name} from {node.module}"
            for path, tree in trees.items() for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("localspec")
            and node.module != "localspec.rounds.events" for alias in node.names if alias.name in events]


def test_events_are_imported_from_events_py_only() -> None:
    """One home for what the loop yields: the package, its tests and the bench scripts import the events from
    localspec/rounds/events.py, never through a module that happens to import them."""
    trees = {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text())
             for folder in ("localspec", "tests", "bench") for p in sorted((ROOT / folder).rglob("*.py"))}
    assert events_from_elsewhere(trees, _event_names()) == []


def test_the_events_check_finds_an_event_imported_from_the_engine() -> None:
    assert {"DoneEvent", "TokenEvent", "GenerationStats", "collect", "STOP_EOG"} <= _event_names()
    tree = ast.parse("from localspec.rounds.engine import Engine, DoneEvent\n"
                     "from localspec.rounds.events import TokenEvent\n")
    assert events_from_elsewhere({"x.py": tree}, _event_names()) == [
        "x.py:1 imports DoneEvent from localspec.rounds.engine"]


# -- the drafter table ------------------------------------------------------------------------------------------------


def _reads_target(drafter: object) -> bool:
    """Whether a built drafter drafts from the target's hidden states (the seam's `reads_target`: the loop hands it
    the target's rows)."""
    return bool(getattr(drafter, "reads_target", False))


def drafter_table_drift(table: dict[str, DrafterFacts], folder: Path = PACKAGE / "drafters") -> list[str]:
    """Where the drafter table disagrees with the package: a drafter module with no row, a row with no module, and a
    row whose facts are not what its module's factory builds (with a draft model and without one, over a fake
    target that carries MTP layers): `needs_draft_model` (built without a draft model, it hands back no drafter of
    its own) and `reads_target` (the drafter it builds reads the target's hidden states)."""
    problems = []
    files = {f"localspec.drafters.{p.stem}" for p in folder.glob("*.py")
             if p.stem != "base" and not p.stem.startswith("_")}
    problems += [f"{module} has no row in config.DRAFTER_TABLE" for module in sorted(files - {r.module for r in
                                                                                           table.values()})]
    modules = {}
    for name, row in sorted(table.items()):
        if row.module not in files:
            problems.append(f"row {name!r} names {row.module}, which is no drafter module of {folder}")
        else:
            modules[name] = importlib.import_module(row.module)
    target, draft = FakeModel(seed=1), FakeModel(seed=2)
    target.mtp_layers = 1  # (the MTP drafter builds over a target with MTP layers; its head is made when used)

    def built_with(draft_model: FakeModel | None) -> dict[str, tuple[object, dict[str, object]]]:
        built: dict[str, object] = {}
        out: dict[str, tuple[object, dict[str, object]]] = {}

        def visit(name: str) -> None:
            if name in out or name not in modules:
                return
            missing = [needed for needed in getattr(modules[name], "NEEDS", ()) if needed not in modules]
            if missing:  # (it cannot be built: its factory reads those it needs)
                if draft_model is not None:
                    problems.extend(f"row {name!r}: its module needs {n!r}, which has no row" for n in missing)
                return
            for needed in getattr(modules[name], "NEEDS", ()):
                visit(needed)
            before = dict(built)
            made = modules[name].build(target, draft_model, before)
            out[name] = (made, before)
            if made is not None and all(made is not other for other in before.values()):
                built[name] = made

        for name in modules:
            visit(name)
        return out

    with_draft, without = built_with(draft), built_with(None)
    for name, (made, _) in with_draft.items():
        own, before = without[name]
        alone = own is not None and all(own is not other for other in before.values())
        if alone == table[name].needs_draft_model:
            problems.append(f"row {name!r}: needs_draft_model={table[name].needs_draft_model}, but its module "
                            + ("builds a drafter without one" if alone else "builds none of its own without one"))
        if made is not None and _reads_target(made) != table[name].reads_target:
            problems.append(f"row {name!r}: reads_target={table[name].reads_target}, but its drafter "
                            + ("reads" if _reads_target(made) else "does not read") + " the target's hidden states")
    return problems


def test_the_drafter_table_matches_the_package() -> None:
    assert drafter_table_drift(DRAFTER_TABLE) == []


def test_the_drafter_table_check_finds_a_module_with_no_row() -> None:
    drifted = {name: row for name, row in DRAFTER_TABLE.items() if name != "lookup"}
    problems = drafter_table_drift(drifted)
    assert "localspec.drafters.lookup has no row in config.DRAFTER_TABLE" in problems
    assert "row 'chain': its module needs 'lookup', which has no row" in problems


def test_the_drafter_table_check_finds_a_row_with_no_module() -> None:
    drifted = {**DRAFTER_TABLE, "eagle": DrafterFacts("localspec.drafters.eagle", "EAGLE-3", reads_target=True)}
    assert drafter_table_drift(drifted) == [
        f"row 'eagle' names localspec.drafters.eagle, which is no drafter module of {PACKAGE / 'drafters'}"]


@pytest.mark.parametrize(("name", "fact", "why"), [
    ("lookup", "needs_draft_model", "builds a drafter without one"),
    ("model", "needs_draft_model", "builds none of its own without one"),
    ("chain", "needs_draft_model", "builds none of its own without one"),
    ("mtp", "reads_target", "reads the target's hidden states"),
    ("model", "reads_target", "does not read the target's hidden states"),
])
def test_the_drafter_table_check_finds_facts_its_module_contradicts(name: str, fact: str, why: str) -> None:
    row = DRAFTER_TABLE[name]
    wrong = not getattr(row, fact)
    drifted = {**DRAFTER_TABLE, name: dataclasses.replace(row, **{fact: wrong})}
    assert drafter_table_drift(drifted) == [f"row {name!r}: {fact}={wrong}, but its module {why}"
                                            if fact == "needs_draft_model" else
                                            f"row {name!r}: {fact}={wrong}, but its drafter {why}"]


# -- model families ---------------------------------------------------------------------------------------------------


def _family_rows() -> list[tuple[str, tuple[str, ...], str, str]]:
    """docs/architecture.md's table of model families: (family, its GGUF architectures, kind, built-in template)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- families:start -->")[1].split("<!-- families:end -->")[0]
    rows = []
    for line in [line for line in block.splitlines() if line.startswith("|")][2:]:  # (past the header)
        family, archs, kind, template = (cell.strip() for cell in line.strip().strip("|").split("|"))
        rows.append((family.strip("`"), tuple(a.strip(" `") for a in archs.split(",")), kind, template.strip("`")))
    return rows


def _shipped_families() -> set[str]:
    import tomllib

    pairs = tomllib.loads((ROOT / "models.toml").read_text())["pair"]
    return {pair[role]["family"] for pair in pairs for role in ("target", "draft") if role in pair}


def family_drift(rows: list[tuple[str, tuple[str, ...], str, str]], families: set[str]) -> list[str]:
    """Where the model-family places disagree: a family of models.toml with no row, an architecture whose kind
    gguf_header.py's sets do not give (attention, hybrid or recurrent; rolls back), a built-in chat template that
    chat.py's `_BUILTIN_BY_ARCH` does not name for it; and gguf_header.py's sets against each other."""
    from localspec.models import gguf_header as g
    from localspec.sessions import chat

    problems = [f"family {f!r} of models.toml has no row in docs/architecture.md's families table"
                for f in sorted(families - {row[0] for row in rows})]
    for family, archs, kind, template in rows:
        for arch in archs:
            known = ("recurrent" if arch in g.RECURRENT_ARCHS else "hybrid" if arch in g.HYBRID_ARCHS
                     else "attention") + (", rolls back" if arch in g.ROLLBACK_ARCHS else "")
            if known != kind:
                problems.append(f"{family}: {arch} is {known!r} in gguf_header.py, the table says {kind!r}")
            builtin = chat._BUILTIN_BY_ARCH.get(arch, "none")
            if builtin != template:
                problems.append(f"{family}: {arch}'s built-in template is {builtin!r} in chat.py, the table says "
                                f"{template!r}")
    problems += [f"gguf_header.py: {arch} rolls back but is neither recurrent nor hybrid"
                 for arch in sorted(g.ROLLBACK_ARCHS - g.RECURRENT_ARCHS - g.HYBRID_ARCHS)]
    problems += [f"gguf_header.py: {arch} is both recurrent and hybrid"
                 for arch in sorted(g.RECURRENT_ARCHS & g.HYBRID_ARCHS)]
    problems += [f"gguf_header.py: the DeltaNet {arch} is no hybrid"
                 for arch in sorted(g._DELTANET_ARCHS - g.HYBRID_ARCHS)]
    return problems


def test_the_model_family_places_agree() -> None:
    """A new architecture touches gguf_header.py, chat.py and models.toml (docs/architecture.md's checklist): the
    families table there says what each shipped family is, and every place must say the same."""
    assert family_drift(_family_rows(), _shipped_families()) == []


def test_the_family_check_finds_each_drift() -> None:
    rows = _family_rows()
    assert {row[0] for row in rows} == _shipped_families()  # (the table is read: one row per shipped family)
    assert family_drift([r for r in rows if r[0] != "qwen3"], _shipped_families()) == [
        "family 'qwen3' of models.toml has no row in docs/architecture.md's families table"]
    hybrid_as_attention = [(f, a, "attention" if f == "qwen3.5" else k, t) for f, a, k, t in rows]
    assert family_drift(hybrid_as_attention, _shipped_families()) == [
        "qwen3.5: qwen35 is 'hybrid, rolls back' in gguf_header.py, the table says 'attention'",
        "qwen3.5: qwen35moe is 'hybrid, rolls back' in gguf_header.py, the table says 'attention'"]
    no_template = [(f, a, k, "none") for f, a, k, t in rows]
    assert family_drift(no_template, _shipped_families()) == [
        "gemma3: gemma3's built-in template is 'gemma' in chat.py, the table says 'none'"]


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


# -- docstrings say what and why -------------------------------------------------------------------------------

# A run's story (the machine it ran on, a date, what the code used to do) belongs in docs/performance.md or a note
# in docs/lab/, where it can be dated and checked against its raw file; a docstring or comment says what and why.
ANECDOTE_PATTERNS = [
    r"\bH[12]00\b",  # a machine the figures came from
    r"\b\d+-core\b",
    r"\bEPYC\b",
    r"\bused to\b",  # what the code did before
    r"\bbefore, ",
    r"\bmeasured:? [~\d]",  # a figure of one run
    r"(?<![\w/.-])20\d\d-\d\d-\d\d(?![\w.-])",  # a date
    r"\bissue #?\d+",
    r"\bon the (?:CUDA |GPU )?(?:image|box)\b",
]
# Files still allowed to carry run anecdotes: none (the whole package is checked).
ANECDOTES_ALLOWED: tuple[str, ...] = ()


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and ast.get_docstring(node, clean=False) is not None:
            found.append((node.body[0].lineno, ast.get_docstring(node, clean=False) or ""))
    return found


def anecdotes(source: str) -> list[tuple[int, str]]:
    """(line, phrase) for each run anecdote in the comments and docstrings of `source` (a path such as
    docs/lab/2026-12-01-host-share.md is a reference, not an anecdote)."""
    pattern = re.compile("|".join(ANECDOTE_PATTERNS))
    paths = re.compile(r"(?:docs|bench)/[\w./-]+")
    return [(line, m.group()) for line, text in _comments_and_docstrings(source)
            for m in pattern.finditer(paths.sub("PATH", text))]


def test_docstrings_and_comments_carry_no_run_anecdotes() -> None:
    found = {rel: hits for rel in (p.relative_to(ROOT).as_posix() for p in sorted(PACKAGE.rglob("*.py")))
             if not rel.startswith(ANECDOTES_ALLOWED) and (hits := anecdotes((ROOT / rel).read_text()))}
    assert found == {}, "say what and why; move the run's figures to docs/performance.md or docs/lab/"


def test_the_anecdote_check_finds_a_run_story() -> None:
    source = ('"""Rounds.\n\nOn the H200 this cost 2.6 ms; it used to be measured 4 ms on the 2-core CPU."""\n'
              "# 2026-12-01: see docs/lab/2026-12-01-host-share.md (a reference is fine)\nX = 1\n")
    assert sorted(anecdotes(source)) == [(1, "2-core"), (1, "H200"), (1, "measured 4"), (1, "used to"),
                                         (4, "2026-12-01")]


ENGINE_LINES, CLASS_LINES = 450, 400  # the loop stays the round; scheduling and slot cells live beside it


def test_the_engine_stays_small_and_no_class_of_its_layer_grows_past_its_bound() -> None:
    """localspec/rounds/engine.py is the round (draft, verify, accept, rewind) and its streams' bookkeeping: round
    scheduling lives in schedule.py, a slot's cells in slot_cells.py, a drafter's concerns in its own file. A new
    capability that lands in the engine instead fails here, as does a class of the engine's layer (the loop, its
    schedules, streams, slot cells, drafters) that outgrows one reading."""
    engine = (PACKAGE / "rounds" / "engine.py").read_text()
    assert len(engine.splitlines()) <= ENGINE_LINES, "engine.py grew: move the new concern out (docs/architecture.md)"
    layer = {path for path, name in _documented().items() if name == "engine"}
    big = {f"{path}:{node.name}": node.end_lineno - node.lineno + 1 for path, tree in _modules().items()
           if path in layer for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
           and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > CLASS_LINES}
    assert big == {}, "split these classes"
