"""Dataset loading, prompts and scoring hooks for the ``safe_*`` lm-eval tasks.

lm-eval imports this file by path (``!function safe_utils.<name>`` in the YAMLs),
so it must not rely on being importable as a module.  Data comes from the public
hub datasets by default, or from a local folder laid out like
``../shared/data`` when ``--metadata '{"data_dir": ...}'`` or the environment
variable ``LM_EVAL_SAFE_DATA_DIR`` is given.  Loading is done by
``custom_dataset`` functions (not ``dataset_path: json``) so that the local path
is computed here from the metadata and never resolved against the cwd of the
lm-eval process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import datasets

#: Environment variable naming the local data folder (same layout as ../shared/data).
DATA_DIR_ENV = "LM_EVAL_SAFE_DATA_DIR"
#: Hub datasets used online; BBH is the copy lm-eval 0.4.13's own ``bbh`` group uses.
MATH500_HUB = ("HuggingFaceH4/MATH-500", None)
GSM8K_HUB = ("openai/gsm8k", "main")
BBH_HUB = "SaylorTwift/bbh"

BBH_TASKS = (
    "boolean_expressions",
    "causal_judgement",
    "date_understanding",
    "disambiguation_qa",
    "dyck_languages",
    "formal_fallacies",
    "geometric_shapes",
    "hyperbaton",
    "logical_deduction_five_objects",
    "logical_deduction_seven_objects",
    "logical_deduction_three_objects",
    "movie_recommendation",
    "multistep_arithmetic_two",
    "navigate",
    "object_counting",
    "penguins_in_a_table",
    "reasoning_about_colored_objects",
    "ruin_names",
    "salient_translation_error_detection",
    "snarks",
    "sports_understanding",
    "temporal_sequences",
    "tracking_shuffled_objects_five_objects",
    "tracking_shuffled_objects_seven_objects",
    "tracking_shuffled_objects_three_objects",
    "web_of_lies",
    "word_sorting",
)


def _load_answer_checking() -> ModuleType:
    """Import ``lm_eval_safe.answer_checking``.

    Falls back to loading that package's folder from a source checkout (``tasks/`` next to
    ``lm_eval_safe/``) under a private name, so that ``lm_eval --include_path tasks`` works
    even when the package is not installed (its modules import one another relatively).
    """
    try:
        from lm_eval_safe import answer_checking

        return answer_checking
    except ImportError:
        folder = Path(__file__).resolve().parent.parent / "lm_eval_safe" / "answer_checking"
        init = folder / "__init__.py"
        if not init.is_file():
            raise
        name = "lm_eval_safe_answer_checking_fallback"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(folder)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module


ac = _load_answer_checking()


class MissingDataError(FileNotFoundError):
    """A local data file is missing; the message is one line naming the path."""


def data_dir_from(kwargs: dict[str, Any]) -> Path | None:
    """Local data folder from lm-eval metadata (``data_dir``) or the env var."""
    value = kwargs.get("data_dir") or os.environ.get(DATA_DIR_ENV)
    if not value:
        return None
    return Path(str(value)).expanduser().resolve()


def _require(path: Path) -> Path:
    if not path.is_file():
        raise MissingDataError(
            f"lm-eval-safe: local data file not found: {path} "
            f"(data_dir from --metadata data_dir or ${DATA_DIR_ENV}; "
            "expected the layout of shared/data)"
        )
    return path


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with _require(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# --------------------------------------------------------------------------
# MATH-500
# --------------------------------------------------------------------------


def load_math500(**kwargs: Any) -> datasets.DatasetDict:
    """MATH-500 test split: local ``math500/test.jsonl`` or ``HuggingFaceH4/MATH-500``."""
    data_dir = data_dir_from(kwargs)
    if data_dir is None:
        path, name = MATH500_HUB
        return datasets.DatasetDict({"test": datasets.load_dataset(path, name, split="test")})
    rows = _read_jsonl(data_dir / "math500" / "test.jsonl")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def math_doc_to_text(doc: dict[str, Any]) -> str:
    """The paper's prompt: ``{problem} Please reason step by step, ... \\boxed{}.``"""
    return doc["problem"] + ac.MATH_PROMPT_SUFFIX


def process_math500(doc: dict[str, Any], results: list[str]) -> dict[str, int]:
    """``exact_match`` (normalised string) and ``math_equiv`` (symbolic) of the answer."""
    generation = results[0] if results else ""
    gold = doc["answer"]
    pred = ac.extract_math_answer(generation or "")
    return {
        "exact_match": ac.as_metric(ac.math_exact_match(pred, gold)),
        "math_equiv": ac.as_metric(ac.math_equiv(generation, gold)),
    }


# --------------------------------------------------------------------------
# GSM8K
# --------------------------------------------------------------------------


def load_gsm8k(**kwargs: Any) -> datasets.DatasetDict:
    """GSM8K test split: local ``gsm8k/test.jsonl`` or ``openai/gsm8k`` (main)."""
    data_dir = data_dir_from(kwargs)
    if data_dir is None:
        path, name = GSM8K_HUB
        return datasets.DatasetDict({"test": datasets.load_dataset(path, name, split="test")})
    rows = _read_jsonl(data_dir / "gsm8k" / "test.jsonl")
    rows = [{"question": r["question"], "answer": r["answer"]} for r in rows]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def gsm8k_doc_to_text(doc: dict[str, Any]) -> str:
    """Same zero-shot CoT instruction as MATH-500 (the paper uses one math prompt)."""
    return doc["question"] + ac.MATH_PROMPT_SUFFIX


def gsm8k_doc_to_target(doc: dict[str, Any]) -> str:
    """The gold number (text after ``####``), shown in logged samples."""
    return doc["answer"].split("####")[-1].strip()


def process_gsm8k(doc: dict[str, Any], results: list[str]) -> dict[str, int]:
    """``exact_match``: the extracted number equals the gold number exactly."""
    generation = results[0] if results else ""
    return {"exact_match": ac.as_metric(ac.gsm8k_match(generation, doc["answer"]))}


#: What a self-consistency vote answers when no sampled solution had a number.
NO_ANSWER = "[invalid]"


def gsm8k_vote_answers(resps: Any, docs: Any) -> list[list[str]]:
    """``custom`` filter of ``safe_gsm8k_sc``: each doc's sampled solutions become their numeric
    answers, ready for lm-eval's ``majority_vote``.

    Solutions without a number are left out of the vote (self-consistency votes over the
    answers of the solutions that reached one); a doc with none votes ``[invalid]``. Answers are
    written ``\\boxed{<exact fraction>}`` so that equal numbers written differently (``1,000``,
    ``1000.0``) count as one, and ``process_gsm8k`` reads them back exactly.
    """
    voted = []
    for responses in resps:
        answers = [ac.extract_gsm8k_answer(r) for r in responses]
        valid = [f"\\boxed{{{a}}}" for a in answers if a is not None]
        voted.append(valid or [NO_ANSWER])
    return voted


# --------------------------------------------------------------------------
# BBH
# --------------------------------------------------------------------------

_COT_MARK = "\nA: Let's think step by step."


def parse_cot_prompt(text: str) -> tuple[str, list[dict[str, str]]]:
    """Split a BBH ``cot-prompts/<task>.txt`` into (description, 3 exemplars).

    The files start with a canary line and ``-----``, then the task description,
    then ``Q: ...\\nA: Let's think step by step.\\n<reasoning>`` blocks separated
    by blank lines (``sports_understanding`` keeps the reasoning on the ``A:``
    line).  Exemplars come out as ``{"input", "target"}`` with the reasoning as
    target, exactly as lm-eval's ``bbh_cot_fewshot`` YAMLs store them.
    """
    lines = text.split("\n")
    if lines and "canary" in lines[0].lower():
        lines = lines[1:]
    if lines and lines[0].startswith("-----"):
        lines = lines[1:]
    body = "\n".join(lines)
    description, rest = body.split("\n\nQ: ", 1)
    samples = []
    for block in ("Q: " + rest).split("\n\nQ: "):
        block = block.removeprefix("Q: ")
        question, answer = block.split(_COT_MARK, 1)
        samples.append({"input": question, "target": answer.lstrip(" \n").rstrip("\n")})
    return description.strip(), samples


def _bbh_exemplars_from_lm_eval(task: str) -> tuple[str, list[dict[str, str]]]:
    """Description and exemplars from the installed lm-eval ``bbh/cot_fewshot`` YAML.

    Used online so that no benchmark text is copied into this repository; the
    tests check these are identical to the BBH repo's ``cot-prompts`` files. lm-eval 0.4.9's
    YAMLs begin each exemplar's answer with a second "Let's think step by step." (the prompt
    already ends with one; later releases dropped it): removed, so that every supported lm-eval
    gives the same prompt.
    """
    import lm_eval
    import yaml

    path = Path(lm_eval.__file__).parent / "tasks" / "bbh" / "cot_fewshot" / f"{task}.yaml"
    with path.open(encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    samples = [
        {"input": s["input"], "target": _without_repeated_cot_opening(s["target"])}
        for s in cfg["fewshot_config"]["samples"]
    ]
    return cfg["description"].strip(), samples


def _without_repeated_cot_opening(target: str) -> str:
    """lm-eval 0.4.9's exemplar answers open with "Let's think step by step." and a newline or,
    in sports_understanding, a space; later releases' do not."""
    for opening in ("Let's think step by step.\n", "Let's think step by step. "):
        if target.startswith(opening):
            return target[len(opening) :]
    return target


def bbh_exemplars(task: str, data_dir: Path | None) -> tuple[str, list[dict[str, str]]]:
    """(description, exemplars) for a BBH task: local cot-prompts file or lm-eval's YAML."""
    if data_dir is None:
        return _bbh_exemplars_from_lm_eval(task)
    path = _require(data_dir / "bbh" / "cot-prompts" / f"{task}.txt")
    return parse_cot_prompt(path.read_text(encoding="utf-8"))


def _bbh_local_examples(task: str, data_dir: Path) -> list[dict[str, str]]:
    path = _require(data_dir / "bbh" / "tasks" / f"{task}.json")
    with path.open(encoding="utf-8") as fh:
        return [{"input": e["input"], "target": e["target"]} for e in json.load(fh)["examples"]]


def load_bbh(bbh_subtask: str, **kwargs: Any) -> datasets.DatasetDict:
    """BBH subtask: ``test`` docs plus a ``fewshot`` split with the 3 CoT exemplars.

    Every test doc carries the task description in ``bbh_description`` (used by
    the template's ``description``) so that the prompt is built by lm-eval's own
    few-shot machinery (chat templates, multiturn) and matches ``bbh_cot_fewshot``.
    """
    if bbh_subtask not in BBH_TASKS:
        raise ValueError(f"lm-eval-safe: unknown BBH subtask {bbh_subtask!r}")
    data_dir = data_dir_from(kwargs)
    description, exemplars = bbh_exemplars(bbh_subtask, data_dir)
    if data_dir is None:
        test = datasets.load_dataset(BBH_HUB, bbh_subtask, split="test")
        test = test.select_columns(["input", "target"])
        rows = list(test)
    else:
        rows = _bbh_local_examples(bbh_subtask, data_dir)
    desc = description + "\n\n"
    test_rows = [{**r, "bbh_description": desc} for r in rows]
    shot_rows = [{**r, "bbh_description": desc} for r in exemplars]
    return datasets.DatasetDict(
        {
            "test": datasets.Dataset.from_list(test_rows),
            "fewshot": datasets.Dataset.from_list(shot_rows),
        }
    )


def process_bbh(doc: dict[str, Any], results: list[str]) -> dict[str, int]:
    """``exact_match`` of the answer after "the answer is" against the target."""
    generation = results[0] if results else ""
    return {"exact_match": ac.as_metric(ac.bbh_match(generation, doc["target"]))}


# --------------------------------------------------------------------------
# Local data for lm-eval's *own* tasks (bbh_cot_fewshot_*, minerva_math500)
# --------------------------------------------------------------------------


def _require_data_dir(kwargs: dict[str, Any], what: str) -> Path:
    data_dir = data_dir_from(kwargs)
    if data_dir is None:
        raise MissingDataError(
            f"lm-eval-safe: {what} reads local data only; pass --metadata "
            f"'{{\"data_dir\": ...}}' or set ${DATA_DIR_ENV}"
        )
    return data_dir


def load_bbh_local_plain(bbh_subtask: str, **kwargs: Any) -> datasets.DatasetDict:
    """Local BBH test docs (``input``, ``target``) for lm-eval's ``bbh_cot_fewshot_*``."""
    if bbh_subtask not in BBH_TASKS:
        raise ValueError(f"lm-eval-safe: unknown BBH subtask {bbh_subtask!r}")
    data_dir = _require_data_dir(kwargs, "bbh_local")
    rows = _bbh_local_examples(bbh_subtask, data_dir)
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_math500_local_plain(**kwargs: Any) -> datasets.DatasetDict:
    """Local MATH-500 test docs for lm-eval's ``minerva_math500``."""
    data_dir = _require_data_dir(kwargs, "minerva_math500_local")
    rows = _read_jsonl(data_dir / "math500" / "test.jsonl")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
