"""The house stays within the sizes it was split to, by concept: no module over 450 lines, no
class over 300; scripts import the package instead of editing ``sys.path``; and code, tests,
scripts, tasks and docs speak of what things are, not of the tracker that asked for them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE = sorted(p for folder in ("lm_eval_safe", "scripts", "tests") for p in (REPO / folder).rglob("*.py"))
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300
# a tracker's item: the word, an optional '#', a number (built so this file does not match)
TRACKER_ITEM = re.compile("iss" + r"ue ?#?[0-9]+", re.IGNORECASE)


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", CODE, ids=_name)
def test_modules_and_classes_stay_small(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count("\n") <= MAX_MODULE_LINES, f"{_name(path)}: split it by concept"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"{_name(path)}: class {node.name} has {size} lines"


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
