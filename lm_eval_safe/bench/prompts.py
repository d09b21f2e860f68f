"""Benchmark prompts from the local data folder (``../shared/data``'s layout)."""

from __future__ import annotations

import json
from pathlib import Path

from lm_eval_safe.answer_checking import MATH_PROMPT_SUFFIX

#: dataset -> the field holding its question
DATASET_FIELDS = {"gsm8k": "question", "math500": "problem"}
#: dataset -> the field holding its worked solution (the answer of a few-shot exemplar)
SOLUTION_FIELDS = {"gsm8k": "answer", "math500": "solution"}


def load_prompts(
    data_dir: Path, dataset: str, n: int, shots: int = 0, cycle: bool = False
) -> list[str]:
    """``n`` prompts; with ``shots``, each starts with that many solved problems (the last ones
    of the file, never among the prompts) as ``Question: ...\\nAnswer: ...`` blocks, as few-shot
    tasks do: bare prompts make instruct members stop at once and flatter every ratio. Bare
    prompts are the paper's math prompt (the question and :data:`MATH_PROMPT_SUFFIX`);
    ``cycle`` repeats the file's questions when ``n`` exceeds them (a long memory run)."""
    path = data_dir / dataset / "test.jsonl"
    if not path.is_file():
        raise SystemExit(f"no data file {path}; pass --data-dir (folder holding {dataset}/)")
    key = DATASET_FIELDS[dataset]
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = [rows[i % len(rows)] for i in range(n)] if cycle else rows[:n]
    if not shots:
        return [row[key] + MATH_PROMPT_SUFFIX for row in chosen]
    answer = SOLUTION_FIELDS[dataset]
    exemplars = "".join(
        f"Question: {row[key]}\nAnswer: {row[answer]}\n\n" for row in rows[len(rows) - shots :]
    )
    return [f"{exemplars}Question: {row[key]}\nAnswer:" for row in chosen]
