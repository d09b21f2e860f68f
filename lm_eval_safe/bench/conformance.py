"""The conformance suite against the SAFE authors' code: its settings, prompts and record.

``lm-eval-safe bench conformance`` runs the authors' ``safe_generate_unite`` and
``safe_generate_gac`` (in the Python their code needs, ``scripts/authors_runner.py``) and this
package on the same real members, prompts and settings, and writes what both produced to
``tests/data/authors_conformance.json``; ``tests/ensemble/authors/test_authors_conformance.py`` holds this
package to that record without any copy of the authors' code. Both take the prompts and the
project's side from here, so a test decodes exactly what the script compared.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lm_eval_safe.bench.prompts import load_prompts
from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.options import parse_options

#: What every case shares: the authors' ``gamma``, top-k and lambda (their code fixes the last
#: two), float32 on the CPU, no chat template and no stop string but the drafter's EOS.
DRAFT_LEN = 5
TOP_K = 10
SHARPEN_LAMBDA = 0.1
DTYPE = "float32"
#: Their ``sharpen_type`` for this package's ``sharpen``.
AUTHORS_SHARPEN = {"heuristic": "heur", "geometric": "geom"}
#: BBH subjects of the suite (short 3-shot chain-of-thought prompts), and GSM8K one-shot.
BBH_TASKS = ("boolean_expressions", "date_understanding", "navigate", "object_counting", "sports_understanding")


@dataclass(frozen=True)
class Setting:
    """One configuration of the suite: a member pair (drafter first) and the method."""

    name: str
    members: tuple[str, str]
    aggregator: str
    sharpen: str
    max_new_tokens: int

    def model_args(self, reference: str) -> dict[str, Any]:
        return {
            "members": list(self.members),
            "aggregator": self.aggregator,
            "sharpen": self.sharpen,
            "schedule": "safe",
            "draft_len": DRAFT_LEN,
            "top_k": TOP_K,
            "sharpen_lambda": SHARPEN_LAMBDA,
            "dtype": DTYPE,
            "reference": reference,
        }


#: The authors' GaC refuses SmolLM2's tokenizer (six control bytes share its unknown id): GaC
#: runs with Qwen2.5-Coder drafting. Their code has no switch for "no sharpening".
SETTINGS = (
    Setting("unite-heuristic", ("smollm2-135m", "gemma3-270m"), "unite", "heuristic", 48),
    Setting("unite-geometric", ("smollm2-135m", "gemma3-270m"), "unite", "geometric", 48),
    Setting("gac-heuristic", ("qwen2.5-coder-0.5b", "gemma3-270m"), "gac", "heuristic", 32),
    Setting("gac-geometric", ("qwen2.5-coder-0.5b", "gemma3-270m"), "gac", "geometric", 32),
)


def bbh_prompt(data_dir: Path, task: str, question: str) -> str:
    """The BBH paper's 3-shot chain-of-thought prompt (its ``cot-prompts`` file after the canary
    lines, then the question)."""
    lines = (data_dir / "bbh" / "cot-prompts" / f"{task}.txt").read_text(encoding="utf-8").split("\n")
    while lines and ("canary" in lines[0].lower() or lines[0].startswith("-----")):
        lines = lines[1:]
    return "\n".join(lines).strip() + f"\n\nQ: {question}\nA: Let's think step by step."


def conformance_prompts(data_dir: Path, gsm8k: int, bbh_per_task: int) -> list[tuple[str, str]]:
    """``(case id, prompt)``: GSM8K's first questions one-shot, then each BBH subject's first ones."""
    cases = [(f"gsm8k-{i}", p) for i, p in enumerate(load_prompts(data_dir, "gsm8k", gsm8k, shots=1))]
    for task in BBH_TASKS:
        examples = json.loads((data_dir / "bbh" / "tasks" / f"{task}.json").read_text(encoding="utf-8"))
        for i, example in enumerate(examples["examples"][:bbh_per_task]):
            cases.append((f"bbh-{task}-{i}", bbh_prompt(data_dir, task, example["input"])))
    return cases


def prompt_digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


@dataclass
class Outcome:
    """One response: its text (special tokens skipped), drafter ids within the budget (a final
    EOS included) and the ensemble points (token positions) within the budget."""

    text: str
    ids: list[int]
    points: list[int]

    def same_as(self, other: Outcome) -> bool:
        return self.ids == other.ids and self.points == other.points


def run_project(
    members: Sequence[Any], setting: Setting, reference: str, prompts: Sequence[str], batch_size: int = 1
) -> list[Outcome]:
    """This package's responses to ``prompts`` under ``setting`` (members loaded in order)."""
    options = parse_options(setting.model_args(reference))
    decoder = SafeDecoder(list(members), 0, options)
    traces: dict[int, dict[str, Any]] = {}
    jobs = [GenerationJob(p, [], setting.max_new_tokens) for p in prompts]
    decoder.generate_many(jobs, batch_size, on_trace=lambda i, t: traces.__setitem__(i, t))
    outcomes = []
    for i in range(len(prompts)):
        ids = traces[i]["ids"]  # the last window may run past the budget: its points are not kept
        outcomes.append(Outcome(traces[i]["text"], ids, [p["position"] for p in traces[i]["points"] if p["position"] < len(ids)]))
    return outcomes


def authors_outcome(drafter_tokenizer: Any, eos_id: int, ids: list[int], points: list[dict[str, int]], budget: int) -> Outcome:
    """The authors' record of a response cut as this package cuts it: at the budget (their last
    window may run past it) and after the first EOS."""
    kept = ids[:budget]
    if eos_id in kept:
        kept = kept[: kept.index(eos_id) + 1]
    text = drafter_tokenizer.decode(kept, skip_special_tokens=True)
    return Outcome(text, kept, [p["position"] for p in points if p["position"] < len(kept)])


def outcome_dict(outcome: Outcome) -> dict[str, Any]:
    return asdict(outcome)
