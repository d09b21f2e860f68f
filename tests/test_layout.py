"""The house stays within the sizes it was split to, by concept: no module over 400 lines, no
class over 250; scripts import the package instead of editing ``sys.path``; code, tests,
scripts, tasks and docs speak of what things are, not of the tracker that asked for them; no
module names an engine outside its own folder; and no import runs in a circle.

Engines (:mod:`lm_eval_safe.engines.registry`): outside ``engines/<name>/`` and the registry, no
module imports ``lm_eval_safe.engines.<name>`` nor holds a string equal to an engine's name (the
``kind == "..."`` of engine-selection code); the rest reaches an engine through its spec. The
one string that may equal one is lm-eval's own model name ``hf`` (``--model hf``, not this
package's engine), where the leaderboard reads other backends' runs.

Imports: the modules of ``lm_eval_safe`` import each other without a circle, every import
counted (a function's too), and so do its rooms (a folder such as ``engines/`` or ``serve/``
taken as one). The one circle is the start-up hook's: the ``.pth`` file imports
:mod:`lm_eval_safe._autoregister`, which reaches :mod:`lm_eval_safe.harness.model` only once lm-eval asks
for the model, and the package's ``register()`` calls it (its docstring says why).
"""

from __future__ import annotations

import ast
import re
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE = sorted(p for folder in ("lm_eval_safe", "scripts", "tests") for p in (REPO / folder).rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_TEST_MODULE_LINES = 450  # a test module holds its fixtures and cases beside each other
MAX_CLASS_LINES = 250
MAX_SCRIPT_FUNCTION_LINES = 80  # a script's steps read as named functions, not one long main
# a tracker's item: the word, an optional '#', a number (built so this file does not match)
TRACKER_ITEM = re.compile("iss" + r"ue ?#?[0-9]+", re.IGNORECASE)


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", CODE, ids=_name)
def test_modules_and_classes_stay_small(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    bound = MAX_TEST_MODULE_LINES if path.relative_to(REPO).parts[0] == "tests" else MAX_MODULE_LINES
    assert text.count("\n") <= bound, f"{_name(path)}: split it by concept"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"{_name(path)}: class {node.name} has {size} lines"


def test_script_functions_stay_short() -> None:
    long = []
    for path in sorted((REPO / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_SCRIPT_FUNCTION_LINES:
                    long.append(f"{_name(path)}: {node.name} has {size} lines")
    assert long == []


def test_scripts_do_not_edit_sys_path() -> None:
    editing = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*(\[[^\]]*\])?\s*[+]?=")
    offenders = [_name(p) for p in (REPO / "scripts").glob("*.py") if editing.search(p.read_text())]
    assert offenders == []


def test_no_tracker_numbers_in_code_tests_scripts_tasks_or_docs() -> None:
    found = []
    pages = [REPO / "README.md", REPO / "BENCHMARKS.md", *(REPO / "docs").rglob("*.md")]
    for folder in ("lm_eval_safe", "tests", "scripts", "tasks"):
        pages.extend((REPO / folder).rglob("*"))
    for path in pages:
        if path.is_file() and path.suffix in (".py", ".yaml", ".md", ".txt", ".jinja", ""):
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if TRACKER_ITEM.search(line):
                    found.append(f"{_name(path)}:{number}: {line.strip()[:80]}")
    assert found == []


PACKAGE = REPO / "lm_eval_safe"
ENGINE_FOLDERS = sorted(p.name for p in (PACKAGE / "engines").iterdir() if (p / "__init__.py").is_file())
#: where a string may equal an engine's name without naming one: lm-eval's own models
LM_EVAL_MODEL_NAMES = {"lm_eval_safe/leaderboard/runs.py"}
#: the benchmark of lm-eval's own backends (``lm-eval-safe bench eval``, a script outside the
#: package until it moved in so a wheel carries it): it names them (``hf``, ``vllm``) and wraps the
#: transformers engine's very model object in lm-eval's ``hf``, at the rows that engine's
#: ``batch_size=auto`` takes on a CPU, so that both runs share weights and batch
LM_EVAL_BACKEND_BENCHMARKS = {"lm_eval_safe/bench/commands/eval.py"}
START_UP_HOOK = {"lm_eval_safe", "lm_eval_safe._autoregister", "lm_eval_safe.harness.model"}
#: the same circle among rooms: the model lies in the lm-eval room, ``harness/``
START_UP_HOOK_ROOMS = {"lm_eval_safe", "lm_eval_safe._autoregister", "lm_eval_safe.harness"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str | None = None) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in it (``from a import b``: the
    module ``a.b`` where there is one, else ``a``); ``name``: the module ``path`` is (default:
    where it lies in the repository)."""
    name = name or _module(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return {m for m in found if m in MODULES and m != name}


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected parts of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = {stack.pop()}
            while node not in part:
                part.add(stack.pop())
            if len(part) > 1:
                circles.append(part)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def _outside_engine_folders() -> list[Path]:
    return [
        p for p in sorted(PACKAGE.rglob("*.py"))
        if p.parent.parent != PACKAGE / "engines" and p != PACKAGE / "engines" / "registry.py"
    ]


def engine_mentions(path: Path, names: set[str], module: str | None = None) -> list[str]:
    """Where ``path`` names an engine: an import of an engine's folder (``lm_eval_safe.engines.
    <name>`` or a module in it), or a string equal to one of ``names`` (``module``: the module
    ``path`` is, for a file outside the repository)."""
    label = _name(path) if path.is_relative_to(REPO) else path.name
    if label in LM_EVAL_BACKEND_BENCHMARKS:
        return []
    found = []
    for imported in _imports(path, module):
        parts = imported.split(".")
        if parts[:2] == ["lm_eval_safe", "engines"] and len(parts) > 2 and parts[2] in ENGINE_FOLDERS:
            found.append(f"{label} imports {imported}")
    if label in LM_EVAL_MODEL_NAMES:
        return found
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip().lower() in names:
            found.append(f"{label}:{node.lineno} names engine {node.value!r}")
    return found


def engines_named_outside_their_folders() -> list[str]:
    """:func:`engine_mentions` over every package module outside the engine folders and the
    registry, for every engine registered now and every engine folder."""
    from lm_eval_safe.engines.registry import engine_names

    names = {*engine_names(), *ENGINE_FOLDERS}
    return [found for path in _outside_engine_folders() for found in engine_mentions(path, names)]


def test_engines_are_named_in_their_folders_and_the_registry_alone() -> None:
    assert engines_named_outside_their_folders() == []


def test_the_rule_sees_an_engine_named_outside_its_folder() -> None:
    """The rule above, run on a probe module, finds both forms (so an empty finding means
    something), and nothing in a module that names no engine. (The probe lies outside the
    repository, where pytest's own folder may not: CI keeps it in the checkout.)"""
    folder = tempfile.TemporaryDirectory()
    probe = Path(folder.name) / "probe.py"
    assert not probe.is_relative_to(REPO)
    probe.write_text('from lm_eval_safe.engines.hf import loading\nif kind == "vllm":\n    pass\n')
    names = set(ENGINE_FOLDERS)
    assert engine_mentions(probe, names, "lm_eval_safe.probe") == [
        "probe.py imports lm_eval_safe.engines.hf.loading",
        "probe.py:2 names engine 'vllm'",
    ]
    probe.write_text('from lm_eval_safe.engines import engine\nif kind == "vlm":\n    pass\n')
    assert engine_mentions(probe, names, "lm_eval_safe.probe") == []
    folder.cleanup()


def test_no_import_circles_among_modules_or_rooms() -> None:
    graph = {name: _imports(path) for name, path in MODULES.items()}
    assert [c for c in _circles(graph) if c != START_UP_HOOK] == []
    rooms: dict[str, set[str]] = {}
    for name, imported in graph.items():
        rooms.setdefault(_room(name), set()).update(_room(m) for m in imported if _room(m) != _room(name))
    assert [c for c in _circles(rooms) if c != START_UP_HOOK_ROOMS] == []


#: The root holds the entry points and the ground floor; every other module lives in the folder
#: of its concept (docs/internals.md, The house).
ROOT_MODULES = {
    "__init__", "_autoregister", "cli", "cli_options", "options", "model_args", "errors", "versions",
    "lm_eval_compat", "disk_cache",
}
#: Each room's floor: a room imports only rooms on lower floors. The one arrow up is the start-up
#: hook's (the package's ``register()`` reaching ``_autoregister``).
FLOORS = {
    "lm_eval_safe": 0, "lm_eval_safe.errors": 0, "lm_eval_safe.disk_cache": 0,
    "lm_eval_safe.answer_checking": 0,
    "lm_eval_safe.versions": 1, "lm_eval_safe.model_args": 1,
    "lm_eval_safe.lm_eval_compat": 2,
    "lm_eval_safe.members": 3,
    "lm_eval_safe.engines": 4,
    "lm_eval_safe.options": 5, "lm_eval_safe.cli_options": 5,
    "lm_eval_safe.ensemble": 6,
    "lm_eval_safe.decoder": 7, "lm_eval_safe.scoring": 7,
    "lm_eval_safe.harness": 8, "lm_eval_safe.leaderboard": 8,
    "lm_eval_safe.bench": 9, "lm_eval_safe._autoregister": 9, "lm_eval_safe.serve": 9,
    "lm_eval_safe.cli": 10,
}
HOOK_ARROW = ("lm_eval_safe", "lm_eval_safe._autoregister")


def _room_graph() -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        rooms.setdefault(_room(name), set()).update(
            _room(m) for m in _imports(path) if _room(m) != _room(name)
        )
    return rooms


def test_the_root_holds_the_entry_points_and_the_ground_floor() -> None:
    assert {p.stem for p in PACKAGE.glob("*.py")} == ROOT_MODULES


def test_each_folder_is_a_concept_the_internals_page_names() -> None:
    folders = sorted(p for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    house = (REPO / "docs" / "internals.md").read_text(encoding="utf-8").split("## The house")[1]
    for init in folders:
        folder = init.parent.relative_to(PACKAGE).as_posix()
        if "/" in folder:  # a folder within a concept: named in its concept's row or below
            assert f"`{folder}/`" in house or f"`{init.parent.name}/`" in house, f"docs/internals.md does not name {folder}/"
            continue
        assert ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))), f"{folder}/ says no concept"
        assert f"| `{folder}/` |" in house, f"docs/internals.md's house table has no row for {folder}/"


def test_imports_run_down_the_floors() -> None:
    rooms = _room_graph()
    assert set(rooms) == set(FLOORS), "place a new room on a floor in FLOORS"
    upward = [
        f"{room} -> {imported}" for room, imports in sorted(rooms.items()) for imported in sorted(imports)
        if FLOORS[imported] >= FLOORS[room] and (room, imported) != HOOK_ARROW
    ]
    assert upward == []


def test_no_test_folder_stands_in_for_a_library() -> None:
    """pytest puts each test file's folder on ``sys.path``: a test folder named as a library
    (``vllm``, ``llama_cpp``) would be found by ``find_spec`` as a namespace package, and tests
    that skip without the library would run where it is not installed."""
    import importlib.util

    folders = {p.name for p in (REPO / "tests").rglob("*") if p.is_dir() and p.name != "__pycache__"}
    libraries = {"vllm", "llama_cpp", "transformers", "torch", "lm_eval", "tokenizers", "gguf", "openai"}
    assert folders & libraries == set()
    shadowed = []
    for name in sorted(folders):  # an installed package of a test folder's name
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        places = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
        if spec and (spec.origin or any(not p.is_relative_to(REPO) for p in places)):
            shadowed.append(name)
    assert shadowed == []
