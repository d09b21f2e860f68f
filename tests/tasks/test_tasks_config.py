"""The task YAMLs in tasks/ load through lm-eval's TaskManager and run end to end.

Everything runs offline from ../shared/data.  Expected prompts are rebuilt from
the raw data files (and lm-eval's own bbh YAMLs), not from the code under test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

TASKS = REPO / "tasks"
DATA = REPO.parent / "shared" / "data"

import lm_eval  # noqa: E402
import yaml  # noqa: E402
from helpers import leaf_tasks  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data not found at {DATA}")]

MATH_SUFFIX = " Please reason step by step, and put your final answer within \\boxed{}."
# docs/algorithm.md, The paper's numbers: the BBH subjects the paper uses.
PAPER_BBH = [
    "boolean_expressions",
    "causal_judgement",
    "date_understanding",
    "disambiguation_qa",
    "formal_fallacies",
    "logical_deduction_three_objects",
    "movie_recommendation",
    "navigate",
    "penguins_in_a_table",
    "reasoning_about_colored_objects",
    "ruin_names",
    "salient_translation_error_detection",
    "snarks",
    "temporal_sequences",
    "tracking_shuffled_objects_three_objects",
]


def _first_jsonl(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as fh:
        return json.loads(fh.readline())


@pytest.fixture(scope="module")
def tm() -> TaskManager:
    return TaskManager(include_path=str(TASKS), metadata={"data_dir": str(DATA)})


def _leaf_tasks(tm: TaskManager, name: str) -> dict[str, Any]:
    return leaf_tasks(tm, [name])


def _prompt(task: Any, doc: dict[str, Any]) -> str:
    return task.fewshot_context(doc, num_fewshot=task.config.num_fewshot or 0)


def test_safe_math500_loads_local_data_and_prompt(tm: TaskManager) -> None:
    tasks = _leaf_tasks(tm, "safe_math500")
    task = tasks["safe_math500"]
    docs = list(task.eval_docs)
    first = _first_jsonl(DATA / "math500" / "test.jsonl")
    assert len(docs) == 500
    assert _prompt(task, docs[0]) == first["problem"] + MATH_SUFFIX
    assert docs[0]["subject"] == first["subject"] and docs[0]["level"] == first["level"]
    assert task.doc_to_target(docs[0]) == first["answer"]
    gen = task.config.generation_kwargs
    assert gen["max_gen_toks"] == 2048 and gen["do_sample"] is False
    # stops must not cut legitimate math: none occurs in any reference solution
    assert not any(stop in d["solution"] for d in docs for stop in gen["until"])


def test_safe_gsm8k_loads_local_data_and_prompt(tm: TaskManager) -> None:
    task = _leaf_tasks(tm, "safe_gsm8k")["safe_gsm8k"]
    docs = list(task.eval_docs)
    first = _first_jsonl(DATA / "gsm8k" / "test.jsonl")
    assert len(docs) == 1319
    assert _prompt(task, docs[0]) == first["question"] + MATH_SUFFIX
    assert task.doc_to_target(docs[0]) == first["answer"].split("####")[-1].strip()
    until = task.config.generation_kwargs["until"]
    assert not any(stop in d["answer"] for d in docs for stop in until)


def test_safe_gsm8k_sc_samples_four_repeats_and_votes(tm: TaskManager) -> None:
    """Self-consistency: safe_gsm8k's prompt and data, 4 sampled repeats, and a majority vote
    over the numeric answers of the solutions that have one."""
    task = _leaf_tasks(tm, "safe_gsm8k_sc")["safe_gsm8k_sc"]
    plain = _leaf_tasks(tm, "safe_gsm8k")["safe_gsm8k"]
    docs = list(task.eval_docs)
    assert _prompt(task, docs[0]) == _prompt(plain, docs[0])
    assert task.config.repeats == 4
    kwargs = task.config.generation_kwargs
    assert kwargs["do_sample"] is True and kwargs["temperature"] == 0.7
    assert kwargs["until"] == plain.config.generation_kwargs["until"]
    vote = dict(task._filters[0].filters[0].keywords)["filter_fn"]  # the custom filter
    resps = [
        ["so 1,000 apples", "The answer is 999.", "\\boxed{1000.0}", "no idea"],
        ["no number here", "nor here", "", "none"],
    ]
    assert list(vote(resps, docs[:2])) == [
        ["\\boxed{1000}", "\\boxed{999}", "\\boxed{1000}"],
        ["[invalid]"],
    ]
    first, maj = (f.name for f in task._filters[::-1])
    assert {first, maj} == {"maj@4", "score-first"}


def _cot_body(task: str) -> str:
    """The BBH cot-prompt file without its canary and ``-----`` header lines."""
    lines = (DATA / "bbh" / "cot-prompts" / f"{task}.txt").read_text(encoding="utf-8").split("\n")
    return "\n".join(lines[2:]).strip("\n")


@pytest.mark.parametrize("group,count", [("safe_bbh", 27), ("safe_bbh_paper", 15)])
def test_safe_bbh_groups(tm: TaskManager, group: str, count: int) -> None:
    tasks = _leaf_tasks(tm, group)
    assert len(tasks) == count
    if group == "safe_bbh_paper":
        assert sorted(tasks) == sorted(f"safe_bbh_{t}" for t in PAPER_BBH)
    total = 0
    for name, task in tasks.items():
        sub = name.removeprefix("safe_bbh_")
        examples = json.loads((DATA / "bbh" / "tasks" / f"{sub}.json").read_text())["examples"]
        docs = list(task.eval_docs)
        assert len(docs) == len(examples)
        total += len(docs)
        assert task.config.num_fewshot == 3
        assert "Q:" in task.config.generation_kwargs["until"]
        if sub != "sports_understanding":  # its file keeps the CoT on the "A:" line
            expected = (
                _cot_body(sub)
                + "\n\nQ: "
                + examples[0]["input"]
                + "\nA: Let's think step by step.\n"
            )
            assert _prompt(task, docs[0]) == expected, sub
    if count == 27:
        assert total == 6511


def test_bbh_exemplars_online_match_the_cot_prompt_files() -> None:
    """Online exemplars come from lm-eval's installed bbh YAMLs; they must equal
    the BBH repo's cot-prompts (parsed here) so online and offline prompts agree."""
    sys.path.insert(0, str(TASKS))
    try:
        import safe_utils
    finally:
        sys.path.remove(str(TASKS))
    lm_dir = Path(lm_eval.__file__).parent / "tasks" / "bbh" / "cot_fewshot"
    for path in sorted((DATA / "bbh" / "cot-prompts").glob("*.txt")):
        online = safe_utils.bbh_exemplars(path.stem, None)
        offline = safe_utils.bbh_exemplars(path.stem, DATA)
        assert online == offline, path.stem
        raw = yaml.safe_load((lm_dir / f"{path.stem}.yaml").read_text())
        assert [s["input"] for s in offline[1]] == [
            s["input"] for s in raw["fewshot_config"]["samples"]
        ]
        assert _cot_body(path.stem).startswith(offline[0])


def test_data_dir_from_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_EVAL_SAFE_DATA_DIR", str(DATA))
    tm_env = TaskManager(include_path=str(TASKS))
    task = leaf_tasks(tm_env, ["safe_gsm8k"])["safe_gsm8k"]
    assert len(list(task.eval_docs)) == 1319


def test_missing_local_file_gives_one_line_error(tmp_path: Path) -> None:
    tm_empty = TaskManager(include_path=str(TASKS), metadata={"data_dir": str(tmp_path)})
    with pytest.raises(FileNotFoundError) as err:
        leaf_tasks(tm_empty, ["safe_math500"])
    message = str(err.value)
    assert str(tmp_path / "math500" / "test.jsonl") in message
    assert "\n" not in message
    with pytest.raises(FileNotFoundError, match="cot-prompts"):
        leaf_tasks(tm_empty, ["safe_bbh_snarks"])


# --------------------------------------------------------------------------
# End to end through lm_eval.simple_evaluate with a fake model
# --------------------------------------------------------------------------


class ReferenceLM(LM):
    """Answers every request with the dataset's own reference (or a wrong one)."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.wrong = wrong
        self.gen_kwargs: list[dict[str, Any]] = []

    def _answer(self, doc: dict[str, Any]) -> str:
        if "problem" in doc:  # MATH-500
            return "\\boxed{-98765}" if self.wrong else doc["solution"]
        if "question" in doc:  # GSM8K
            return "The answer is 123456789." if self.wrong else doc["answer"]
        target = "none of these" if self.wrong else doc["target"]
        return f"Let's see. So the answer is {target}."

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        self.gen_kwargs.extend(r.args[1] for r in requests)
        return [self._answer(r.doc) for r in requests]

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list:
        raise NotImplementedError

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list:
        raise NotImplementedError


_EXPECTED_METRICS = {
    "safe_math500": ["exact_match,none", "math_equiv,none"],
    "safe_gsm8k": ["exact_match,none"],
    "safe_bbh": ["exact_match,none"],
    "safe_bbh_paper": ["exact_match,none"],
}


@pytest.mark.parametrize("wrong", [False, True], ids=["reference", "wrong"])
def test_end_to_end_with_reference_model(tm: TaskManager, wrong: bool) -> None:
    lm = ReferenceLM(wrong=wrong)
    expected = 0.0 if wrong else 1.0
    for name, metrics in _EXPECTED_METRICS.items():
        out = lm_eval.simple_evaluate(
            model=lm, tasks=[name], limit=2, task_manager=tm, log_samples=True
        )
        results = out["results"]
        for metric in metrics:
            assert results[name][metric] == expected, (name, metric, results[name])
        if name == "safe_math500":
            doc = out["samples"]["safe_math500"][0]["doc"]
            assert "subject" in doc and "level" in doc


def test_gen_kwargs_override_max_gen_toks(tm: TaskManager) -> None:
    lm = ReferenceLM()
    lm_eval.simple_evaluate(
        model=lm, tasks=["safe_math500"], limit=1, task_manager=tm, gen_kwargs="max_gen_toks=64"
    )
    assert lm.gen_kwargs and all(g["max_gen_toks"] == 64 for g in lm.gen_kwargs)
    assert "\n\nProblem:" in lm.gen_kwargs[0]["until"]


def test_lm_eval_own_tasks_on_local_data(tm: TaskManager) -> None:
    """bbh_local / minerva_math500_local: lm-eval's own configs, local docs."""
    lm = ReferenceLM()
    out = lm_eval.simple_evaluate(model=lm, tasks=["bbh_local"], limit=1, task_manager=tm)
    assert out["results"]["bbh_local"]["exact_match,get-answer"] == 1.0
    assert lm.gen_kwargs[0]["until"] == ["</s>", "Q", "\n\n"]  # unchanged lm-eval config
    if not (Path(lm_eval.__file__).parent / "tasks" / "minerva_math" / "minerva_math500.yaml").is_file():
        return  # lm-eval 0.4.9 ships no minerva_math500 to run on local data (tasks/README.md)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=["minerva_math500_local"], limit=2, task_manager=tm
    )
    assert out["results"]["minerva_math500"]["math_verify,none"] == 1.0


def test_math500_breakdown_script_reads_logged_samples(tm: TaskManager, tmp_path: Path) -> None:
    out = lm_eval.simple_evaluate(
        model=ReferenceLM(), tasks=["safe_math500"], limit=4, task_manager=tm, log_samples=True
    )
    samples = out["samples"]["safe_math500"]
    path = tmp_path / "samples_safe_math500.jsonl"
    path.write_text("".join(json.dumps(s, default=str) + "\n" for s in samples))
    spec = importlib.util.spec_from_file_location(
        "math500_breakdown", REPO / "scripts" / "math500_breakdown.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.load_samples([path])
    by_subject = script.breakdown(rows, "subject")
    first4 = [
        json.loads(line) for line in (DATA / "math500" / "test.jsonl").read_text().splitlines()[:4]
    ]
    assert sum(r["n"] for r in by_subject.values()) == 4
    assert set(by_subject) == {r["subject"] for r in first4}
    assert all(r["math_equiv"] == 1.0 for r in by_subject.values())
    assert set(script.breakdown(rows, "level")) == {str(r["level"]) for r in first4}
