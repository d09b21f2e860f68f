"""lm-eval output folders read back as leaderboard runs: the configuration that produced them,
each task's :class:`~lm_eval_safe.leaderboard.result_cache.Outcome`, every sample and, for
``trace=true`` ensembles, every response's trace.

A folder is what ``lm_eval --output_path DIR --log_samples`` writes (``results_<date>.json``
and ``samples_<task>_<date>.jsonl``, in a subfolder named after the model) or a folder above
several of them, such as a ``lm-eval-safe leaderboard`` output. ``--model hf`` runs are members
alone. Anything that would make a report lie (no samples, a trace that does not belong to its
samples, two runs of one configuration, one task at two limits) is a :class:`RunsError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_eval_safe.engines.registry import DEFAULT_ENGINE
from lm_eval_safe.errors import UserError
from lm_eval_safe.leaderboard.configs import ALONE_PREFIX, ENSEMBLE_CONFIGS
from lm_eval_safe.leaderboard.result_cache import Outcome, pick_metric, sample_count
from lm_eval_safe.model_args import member_display_name, parse_model_args

#: lm-eval's names of its transformers backend (registry names, and the class passed as an object)
HF_MODELS = ("hf", "hf-auto", "huggingface", "HFLM")
_RESULTS = re.compile(r"^results_(?P<date>.+)\.json$")


class RunsError(UserError, ValueError):
    """A folder that cannot be reported truthfully; the message says which and why."""


@dataclass
class Sample:
    """One document of one (sub)task as a run answered it."""

    doc_id: int
    correct: bool | None  # the task's headline metric, None when the sample has none
    responses: list[str]  # one per repeat
    target: str
    prompt: str
    traces: dict[int, dict[str, Any]] = field(default_factory=dict)  # repeat -> trace line


@dataclass
class Run:
    """One lm-eval run: one configuration on one or more tasks."""

    folder: Path
    config: str
    is_single: bool
    members: list[str]
    outcomes: dict[str, Outcome]  # top-level task -> its figures
    samples: dict[str, dict[int, Sample]]  # leaf task -> doc_id -> sample
    limits: dict[str, Any]
    traced: bool
    #: top-level task -> the leaf tasks whose samples it holds (a group's subtasks; a task
    #: that is no group: itself)
    leaves: dict[str, list[str]] = field(default_factory=dict)

    def task_samples(self, task: str) -> dict[tuple[str, int], Sample]:
        """Every sample of a top-level task, keyed by (leaf task, doc_id)."""
        return {(leaf, doc): s for leaf in self.leaves.get(task, [task]) for doc, s in self.samples.get(leaf, {}).items()}


def _configuration(config: dict[str, Any], folder: Path) -> tuple[str, bool, list[str]]:
    """(name, is a member alone, member names) of a run, named as the leaderboard names its rows."""
    model = config.get("model")  # a registry name, or the class of a model object passed in
    if model in HF_MODELS:
        args = parse_model_args(config.get("model_args") or "")
        if "pretrained" not in args:
            raise RunsError(f"{folder}: an hf run without pretrained= in its model_args")
        name = member_display_name(str(args["pretrained"]))
        return f"{ALONE_PREFIX}{name} (hf)", True, [name]
    if model not in ("safe-ensemble", "SafeEnsembleLM"):
        raise RunsError(
            f"{folder}: a run of --model {model}; the report compares safe-ensemble runs and "
            "members alone under --model hf"
        )
    if "members" not in config:
        raise RunsError(f"{folder}: its results carry no safe-ensemble model info (members, safe_stats)")
    members = [m["name"] for m in config["members"]]
    # the same members and options on another engine are another run (other kernels, other
    # texts): named apart, so one report can set engines side by side (runs written before
    # members named their engine ran on transformers)
    engines = sorted({m.get("engine", DEFAULT_ENGINE) for m in config["members"]})
    on = "" if engines == [DEFAULT_ENGINE] else f" on {'+'.join(engines)}"
    if len(members) == 1:
        return f"{ALONE_PREFIX}{members[0]}{on}", True, members
    options = config["safe_options"]
    wanted = {
        "schedule": options["schedule"],
        "aggregator": options["aggregator"],
        "sharpen": options["sharpen"],
    }
    name = f"{options['aggregator']}-{options['schedule']}-sharpen-{options['sharpen']}"
    for candidate, args in ENSEMBLE_CONFIGS.items():
        given = dict(item.split("=", 1) for item in args.split(","))
        if {k: given.get(k, "heuristic" if k == "sharpen" else None) for k in wanted} == wanted:
            name = candidate
            break
    drafter = config.get("drafter", members[0])
    return f"{name} ({'+'.join(members)}, {drafter} drafts){on}", False, members


def _top_level_tasks(results: dict[str, Any]) -> list[str]:
    groups = results.get("group_subtasks", {})
    inner = {t for subs in groups.values() for t in subs}
    return [t for t in results.get("results", {}) if t not in inner]


def _leaf_tasks(results: dict[str, Any]) -> list[str]:
    groups = results.get("group_subtasks", {})
    return [t for t in results.get("results", {}) if not groups.get(t)]


def _leaves_of(task: str, groups: dict[str, list[str]]) -> list[str]:
    """The leaf tasks under ``task`` (groups may hold groups)."""
    subtasks = groups.get(task) or []
    return [leaf for sub in subtasks for leaf in _leaves_of(sub, groups)] if subtasks else [task]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _metric_name(metrics: dict[str, Any]) -> str | None:
    key, _ = pick_metric(metrics)
    return None if key is None else key.split(",")[0]


def _samples(folder: Path, date: str, task: str, metric: str | None) -> dict[int, Sample]:
    path = folder / f"samples_{task}_{date}.jsonl"
    if not path.is_file():
        raise RunsError(
            f"{folder}: no {path.name}: run lm_eval with --log_samples (the report needs every answer)"
        )
    samples = {}
    for row in _read_jsonl(path):
        value = row.get(metric) if metric else None
        resps = row.get("resps") or [[]]
        samples[int(row["doc_id"])] = Sample(
            doc_id=int(row["doc_id"]),
            correct=None if value is None else bool(float(value) >= 0.5),
            responses=[str(r) for r in resps[0]],
            target=str(row.get("target", "")),
            prompt=str(row.get("arguments", {}).get("gen_args_0", {}).get("arg_0", "")),
        )
    return samples


def _attach_traces(folder: Path, date: str, task: str, samples: dict[int, Sample]) -> bool:
    paths = sorted(folder.glob(f"traces_{task}_{date}*.jsonl"))
    for path in paths:
        for line in _read_jsonl(path):
            sample = samples.get(int(line["doc_id"]))
            repeat = int(line["repeat"])
            if sample is None or repeat >= len(sample.responses):
                raise RunsError(
                    f"{path}: a trace of doc {line['doc_id']} repeat {repeat}, which {task}'s "
                    "samples do not have: the trace belongs to another run"
                )
            if line["text"] != sample.responses[repeat]:
                raise RunsError(
                    f"{path}: the trace of doc {line['doc_id']} is of another response than the "
                    "samples file's: the trace belongs to another run"
                )
            sample.traces[repeat] = line
    return bool(paths)


def read_run(results_path: Path) -> Run:
    """One ``results_<date>.json`` with the samples and traces of the same date beside it."""
    match = _RESULTS.match(results_path.name)
    if match is None:
        raise RunsError(f"{results_path}: not an lm-eval results_<date>.json")
    folder, date = results_path.parent, match["date"]
    results = json.loads(results_path.read_text(encoding="utf-8"))
    config = results.get("config", {})
    name, single, members = _configuration(config, folder)
    stats = config.get("safe_stats") or {}
    wall = float(results.get("total_evaluation_time_seconds") or 0.0)
    outcomes = {}
    for task in _top_level_tasks(results):
        metric, accuracy = pick_metric(results["results"][task])
        outcomes[task] = Outcome(
            config=name,
            task=task,
            accuracy=accuracy,
            metric=metric,
            n=sample_count(results, task),
            et_percent=stats.get("ensemble_rate_percent"),
            acceptance=stats.get("acceptance_rate") if not single else None,
            tokens_per_second=stats.get("tokens_per_second"),
            generated_tokens=stats.get("generated_tokens"),
            wall_seconds=wall,
            cached=False,
        )
    samples, traced = {}, False
    for task in _leaf_tasks(results):
        metric = _metric_name(results["results"][task])
        samples[task] = _samples(folder, date, task, metric)
        traced = _attach_traces(folder, date, task, samples[task]) or traced
    limit = config.get("limit")
    groups = results.get("group_subtasks", {})
    leaves = {task: _leaves_of(task, groups) for task in outcomes}
    return Run(folder, name, single, members, outcomes, samples, {t: limit for t in samples}, traced, leaves)


def read_runs(folders: Sequence[Path]) -> list[Run]:
    """Every run under the folders; members alone first (the gap column refers to them)."""
    runs: list[Run] = []
    for folder in folders:
        if not folder.is_dir():
            raise RunsError(f"{folder}: no such folder")
        found = sorted(folder.rglob("results_*.json"))
        if not found:
            raise RunsError(f"{folder}: no lm-eval results_*.json in it (was it an --output_path?)")
        runs += [read_run(path) for path in found]
    seen: dict[str, Run] = {}
    for run in runs:
        for task in run.outcomes:
            key = f"{run.config}\x00{task}"
            if key in seen:
                raise RunsError(
                    f"{run.folder} and {seen[key].folder}: both are {run.config} on {task}; "
                    "pass one run per configuration and task"
                )
            seen[key] = run
    limits: dict[str, tuple[Any, Run]] = {}
    for run in runs:
        for task, limit in run.limits.items():
            if task in limits and limits[task][0] != limit:
                other = limits[task][1]
                raise RunsError(
                    f"{run.folder} ran {task} with limit {limit}, {other.folder} with limit "
                    f"{limits[task][0]}: the per-question grid needs the same questions"
                )
            limits.setdefault(task, (limit, run))
    return sorted(runs, key=lambda r: (not r.is_single, r.config))
