"""Answer extraction and equivalence checking of the safe_* tasks.

The full-data tests score every reference answer of MATH-500, BBH and GSM8K
(the datasets' own answers are the independent reference) and pair each
problem with a *different* problem's answer to bound false positives.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

DATA = REPO.parent / "shared" / "data"

from lm_eval_safe import answer_checking as ac  # noqa: E402

needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data not found at {DATA}")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="module")
def checkers() -> list[ac.SymbolicChecker]:
    """Two worker processes, one per CPU core, for the full-data checks."""
    pool = [ac.SymbolicChecker(), ac.SymbolicChecker()]
    yield pool
    for c in pool:
        c.close()


def _parallel(fn, items: list[Any], checkers: list[ac.SymbolicChecker]) -> list[Any]:
    """Run ``fn(item, checker)`` over items, each thread owning one checker."""
    chunks = [items[i :: len(checkers)] for i in range(len(checkers))]
    with ThreadPoolExecutor(len(checkers)) as ex:
        parts = list(
            ex.map(lambda ck: [fn(x, ck[1]) for x in ck[0]], zip(chunks, checkers, strict=True))
        )
    out: list[Any] = [None] * len(items)
    for k, part in enumerate(parts):
        out[k :: len(checkers)] = part
    return out


# --------------------------------------------------------------------------
# MATH-500 on the real data
# --------------------------------------------------------------------------


@needs_data
def test_math500_reference_solutions_score_correct(checkers: list[ac.SymbolicChecker]) -> None:
    rows = _jsonl(DATA / "math500" / "test.jsonl")
    assert len(rows) == 500
    ok = _parallel(lambda r, c: ac.math_equiv(r["solution"], r["answer"], c), rows, checkers)
    failures = [(r["unique_id"], r["answer"]) for r, good in zip(rows, ok, strict=True) if not good]
    assert failures == [], failures


@needs_data
def test_math500_other_problems_answer_scores_wrong(checkers: list[ac.SymbolicChecker]) -> None:
    rows = _jsonl(DATA / "math500" / "test.jsonl")
    pairs = []
    for i, r in enumerate(rows):
        # the next problem whose reference answer differs as a string
        j = (i + 1) % len(rows)
        while rows[j]["answer"].replace(" ", "") == r["answer"].replace(" ", ""):
            j = (j + 1) % len(rows)
        pairs.append((r, rows[j]))
    scored = _parallel(
        lambda p, c: ac.math_equiv(p[1]["solution"], p[0]["answer"], c), pairs, checkers
    )
    coincidences = [
        (p[0]["answer"], p[1]["answer"]) for p, s in zip(pairs, scored, strict=True) if s
    ]
    # Known genuine coincidence: "5" vs "x=5" (MATH accepts "x = 5" for 5).
    assert len(coincidences) <= 2, coincidences


@needs_data
def test_math500_integer_answers_in_other_forms_need_symbolic_check(
    checkers: list[ac.SymbolicChecker],
) -> None:
    """Exercise the symbolic path on real answers: n written as (2n)/2 and n+0.0."""
    rows = [r for r in _jsonl(DATA / "math500" / "test.jsonl") if r["answer"].strip().isdigit()]
    assert len(rows) > 100
    rows = rows[:120]

    def check(r: dict[str, Any], c: ac.SymbolicChecker) -> tuple[bool, bool, bool]:
        n = int(r["answer"])
        frac = f"\\boxed{{\\frac{{{2 * n}}}{{2}}}}"
        wrong = f"\\boxed{{\\frac{{{2 * n + 1}}}{{2}}}}"
        return (
            ac.math_exact_match(ac.extract_math_answer(frac), r["answer"]),
            ac.math_equiv(frac, r["answer"], c),
            ac.math_equiv(wrong, r["answer"], c),
        )

    results = _parallel(check, rows, checkers)
    assert not any(em for em, _, _ in results)  # strings differ ...
    assert all(eq for _, eq, _ in results)  # ... but the values are equal
    assert not any(w for _, _, w in results)


# --------------------------------------------------------------------------
# BBH and GSM8K on the real data
# --------------------------------------------------------------------------


def _bbh_tasks() -> dict[str, list[dict[str, str]]]:
    out = {}
    for path in sorted((DATA / "bbh" / "tasks").glob("*.json")):
        out[path.stem] = json.loads(path.read_text(encoding="utf-8"))["examples"]
    return out


@needs_data
def test_bbh_reference_answers_score_correct_and_others_wrong() -> None:
    tasks = _bbh_tasks()
    assert len(tasks) == 27
    total = wrong_ref = coincidences = 0
    for examples in tasks.values():
        targets = [e["target"] for e in examples]
        for i, target in enumerate(targets):
            total += 1
            if not ac.bbh_match(f"Let's think step by step. So the answer is {target}.", target):
                wrong_ref += 1
            other = next(
                t
                for t in targets[i + 1 :] + targets[:i]
                if t.strip().lower() != target.strip().lower()
            )
            if ac.bbh_match(f"So the answer is {other}.", target):
                coincidences += 1
    assert total == 6511
    assert wrong_ref == 0
    assert coincidences == 0


@needs_data
def test_gsm8k_reference_answers_score_correct_and_others_wrong() -> None:
    rows = _jsonl(DATA / "gsm8k" / "test.jsonl")
    assert len(rows) == 1319

    def gold(r: dict[str, Any]) -> float:  # independent parse of "#### N"
        return float(r["answer"].split("####")[-1].strip().replace(",", ""))

    bad = [r["answer"][-30:] for r in rows if not ac.gsm8k_match(r["answer"], r["answer"])]
    assert bad == []
    boxed = [r for r in rows if not ac.gsm8k_match(f"So \\boxed{{{gold(r):g}}}.", r["answer"])]
    assert boxed == []
    coincidences = 0
    for i, r in enumerate(rows):
        j = (i + 1) % len(rows)
        while gold(rows[j]) == gold(r):
            j = (j + 1) % len(rows)
        coincidences += ac.gsm8k_match(rows[j]["answer"], r["answer"])
    assert coincidences == 0


# --------------------------------------------------------------------------
# Adversarial extraction and equivalence cases
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{\\frac{1}{\\sqrt{2}}}$.", "\\frac{1}{\\sqrt{2}}"),
        ("first \\boxed{3}, finally \\boxed{4}", "4"),
        ("The answer is $\\boxed 5$.", "5"),
        ("\\fbox{x^{2}+1}", "x^{2}+1"),
        ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{3} and then \\boxed{\\frac{1}{", "3"),  # unclosed last box: earlier one
        ("Final Answer: The final answer is $12$. I hope it is correct.", "12"),
        ("Thus the answer is 7.", "7"),
        ("Final Answer: -3", "-3"),
        ("no answer here", None),
        ("", None),
    ],
)
def test_extract_math_answer(text: str, expected: str | None) -> None:
    assert ac.extract_math_answer(text) == expected


@pytest.mark.parametrize(
    ("generation", "gold"),
    [
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})"),
        ("\\boxed{[2, 5)}", "[2,5)"),
        ("\\boxed{(-\\infty, 0) \\cup (1, \\infty)}", "(-\\infty,0)\\cup(1,\\infty)"),
        (
            "\\boxed{\\begin{pmatrix} 1 \\\\ -2 \\end{pmatrix}}",
            "\\begin{pmatrix}1\\\\-2\\end{pmatrix}",
        ),
        ("\\boxed{-7}", "-7"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{30^\\circ}", "30"),
        ("\\boxed{\\$18.90}", "18.90"),
        ("\\boxed{10\\text{ inches}}", "10"),
        ("\\boxed{\\text{(C)}}", "\\text{(C)}"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{(x+1)^2}", "x^2+2x+1"),
        ("\\boxed{x = 3}", "3"),
        ("\\boxed{\\text{second}}", "\\text{second}"),
        ("\\boxed{\\sqrt3}", "\\sqrt{3}"),
        ("\\boxed{5.}", "5"),
        ("\\boxed{3\\!\\cdot\\!2}", "6"),
    ],
)
def test_math_equiv_accepts_equivalent_forms(generation: str, gold: str) -> None:
    assert ac.math_equiv(generation, gold)


@pytest.mark.parametrize(
    ("generation", "gold"),
    [
        ("\\boxed{(2, 5)}", "[2,5)"),
        ("\\boxed{(3, 2)}", "(2,3)"),
        ("\\boxed{-7}", "7"),
        ("\\boxed{1,001}", "1000"),
        (
            "\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}",
            "\\begin{pmatrix}1\\\\-2\\end{pmatrix}",
        ),
        ("\\boxed{\\text{(B)}}", "\\text{(C)}"),
        ("\\boxed{\\sqrt{2}}", "2"),
        ("\\boxed{2a+b}", "2+b"),
        ("\\boxed{\\text{minutes}}", "\\text{second}"),  # both are "unit" words
        ("first \\boxed{4} then \\boxed{3}", "4"),
    ],
)
def test_math_equiv_rejects_different_answers(generation: str, gold: str) -> None:
    assert not ac.math_equiv(generation, gold)


@pytest.mark.parametrize(
    ("generation", "target"),
    [
        ("So the answer is (A).", "(A)"),
        ("so The answer is A.", "(A)"),
        ("So the answer is (A) 12/14/1937.", "(A)"),
        ("**The answer is (C)**", "(C)"),
        ("So the answer is True.", "True"),
        ("So the answer is valid", "valid"),
        ("So the answer is ] ) }.", "] ) }"),
        ("So the answer is apple  banana cherry.", "apple banana cherry"),
        ("the answer is 24.", "24"),
    ],
)
def test_bbh_match_accepts(generation: str, target: str) -> None:
    assert ac.bbh_match(generation, target)


@pytest.mark.parametrize(
    ("generation", "target"),
    [
        ("So the answer is (B).", "(A)"),
        ("So the answer is (A). Wait, the answer is (B).", "(A)"),
        ("So the answer is False.", "True"),
        ("So the answer is invalid.", "valid"),
        ("(A)", "(A)"),  # no "the answer is": not extracted
        ("So the answer is Apple.", "(A)"),
        ("", "(A)"),
    ],
)
def test_bbh_match_rejects(generation: str, target: str) -> None:
    assert not ac.bbh_match(generation, target)


@pytest.mark.parametrize(
    ("generation", "answer_field", "expected"),
    [
        ("She makes 9 * 2 = $18 a day. The answer is 18.", "#### 18", True),
        ("Total: \\boxed{1,000}", "#### 1000", True),
        ("Total is \\boxed{\\$18.00}.", "#### 18", True),
        ("so -5 degrees", "#### -5", True),
        ("I get 12 then 13", "#### 13", True),
        ("I get 13 then 12", "#### 13", False),
        ("\\boxed{18} and later 20", "#### 18", True),
        ("", "#### 18", False),
    ],
)
def test_gsm8k_match(generation: str, answer_field: str, expected: bool) -> None:
    assert ac.gsm8k_match(generation, answer_field) is expected


# --------------------------------------------------------------------------
# Bad input: wrong, fast, no exception escapes, no hang (also off the main thread)
# --------------------------------------------------------------------------

_HUGE = ("Let x = 12345 and \\boxed{" + "{" * 50 + "1 + ") * 2000 + "}" * 10
_BAD_GENERATIONS = [
    "",
    "   \n\n ",
    "A" * 100_000,
    _HUGE[:100_000],
    ("the answer is " * 8000)[:100_000],
    "\\boxed{\\frac{1}{",
    "\\boxed{\\sqrt{}}",
    "\\boxed{\\frac{}{}}",
    "\\boxed{)(][}",
    "\\boxed{\\begin{pmatrix} 1 & \\end{bmatrix}}",
    "\\boxed{\\left(}",
    "\\boxed{1/0}",
    "\\boxed{\\x\\y\\z}",
]


@pytest.mark.parametrize("generation", _BAD_GENERATIONS, ids=range(len(_BAD_GENERATIONS)))
def test_bad_generations_score_wrong_quickly(generation: str) -> None:
    start = time.monotonic()
    assert not ac.math_equiv(generation, "\\frac{3}{4}")
    assert not ac.math_exact_match(ac.extract_math_answer(generation), "\\frac{3}{4}")
    assert not ac.gsm8k_match(generation, "#### 7")
    assert not ac.bbh_match(generation, "(A)")
    assert time.monotonic() - start < 15


def test_stalled_symbolic_check_times_out_off_the_main_thread() -> None:
    """A worker that never answers is killed at the deadline, from a non-main thread.

    (signal.alarm would not work here.)  The stalling worker stands in for a
    sympy computation that never ends.
    """
    stall = [
        sys.executable,
        "-c",
        "import time; print('{\"ready\": true}', flush=True); time.sleep(600)",
    ]
    checker = ac.SymbolicChecker(timeout_s=1.0, worker_cmd=stall)
    result: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        result["eq"] = ac.math_equiv("\\boxed{\\frac{6}{8}}", "0.75", checker)
        result["elapsed"] = time.monotonic() - start

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "symbolic check hung"
    assert result["eq"] is False
    assert result["elapsed"] < 20
    assert checker.timeouts >= 1
    checker.close()


def test_towers_of_powers_do_not_hang() -> None:
    start = time.monotonic()
    checker = ac.SymbolicChecker(timeout_s=3.0)
    assert not ac.math_equiv("\\boxed{9^{9^{9^{9^{9}}}} - 1}", "9^{9^{9^{9^{9}}}}", checker)
    assert not ac.math_equiv("\\boxed{2^{2^{40}}+1}", "2^{2^{40}}", checker)
    # the checker still works afterwards
    assert ac.math_equiv("\\boxed{\\frac{2}{4}}", "0.5", checker)
    checker.close()
    assert time.monotonic() - start < 60


def test_task_hooks_load_answer_checking_by_path_without_the_package() -> None:
    """``lm_eval --include_path tasks`` from a checkout where ``lm_eval_safe`` is not installed:
    safe_utils loads the answer-checking folder by path, and its symbolic worker (started from
    its own file by path) still answers."""
    import subprocess

    program = textwrap.dedent(
        f"""
        import importlib.util, sys
        sys.modules["lm_eval_safe"] = None  # the package cannot be imported
        spec = importlib.util.spec_from_file_location("safe_utils", {str(REPO / "tasks" / "safe_utils.py")!r})
        utils = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(utils)
        assert utils.ac.__name__ == "lm_eval_safe_answer_checking_fallback", utils.ac.__name__
        assert utils.math_doc_to_text({{"problem": "1+1?"}}).endswith("within \\\\boxed{{}}.")
        print(utils.process_math500({{"answer": "0.5"}}, ["so \\\\boxed{{\\\\frac{{2}}{{4}}}}"]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "{'exact_match': 0, 'math_equiv': 1}"  # symbolic only
