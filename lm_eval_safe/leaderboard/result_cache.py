"""Finished leaderboard cells on disk, and the rows read back from them.

Runs on a CPU take minutes to hours, so every finished (configuration, task, limit) is written
at once to its own JSON file (atomically, :func:`lm_eval_safe.disk_cache.atomic_write_json`).
A second invocation with the same settings reads those files and runs only what is missing:
an interrupted run resumes. The file name carries a hash of everything that changes the
numbers (members, model_args, generation budget, chat template, limit), so changing a setting
never reuses a stale result.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_safe.leaderboard.configs import Config

#: Bump when the layout of a cache file changes, so old files are not misread.
CACHE_FORMAT = 1
#: Metrics in order of preference for the headline accuracy of a task. ``math_equiv``
#: (symbolic equivalence) is what the paper's MATH numbers correspond to; the others
#: report ``exact_match``.
PRIMARY_METRICS = ("math_equiv", "exact_match")


@dataclass
class Outcome:
    """What the table needs from one finished (configuration, task) run."""

    config: str
    task: str
    accuracy: float | None  # fraction in [0, 1]
    metric: str | None
    n: int
    et_percent: float | None
    acceptance: float | None
    tokens_per_second: float | None
    generated_tokens: int | None
    wall_seconds: float
    cached: bool


def slug(text: str) -> str:
    """File-name-safe form of a configuration or task name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


@dataclass(frozen=True)
class CellKey:
    """Everything that changes the numbers of one (configuration, task) cell: its cache file is
    named by a hash of these, so changing any of them never reuses a stale result."""

    config: Config
    task: str
    limit: float | None
    model_args: str
    gen_kwargs: dict[str, Any]
    apply_chat_template: bool  # as asked for; a member without a template runs without one

    def path(self, out: Path) -> Path:
        """``<out>/cache/<config>__<task>__limit<N>__<hash>.json``."""
        key = json.dumps(
            {
                "format": CACHE_FORMAT,
                "model_args": self.model_args,
                "task": self.task,
                "limit": self.limit,
                "gen_kwargs": self.gen_kwargs,
                "apply_chat_template": self.apply_chat_template,
            },
            sort_keys=True,
        )
        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        limit_part = "all" if self.limit is None else f"{self.limit:g}"
        name = f"{slug(self.config.name)}__{slug(self.task)}__limit{limit_part}__{digest}.json"
        return out / "cache" / name


def read_record(path: Path) -> dict[str, Any]:
    """A cache record as :func:`make_record` wrote it."""
    return json.loads(path.read_text())


def make_record(
    key: CellKey,
    applied_chat_template: bool,
    wall_seconds: float,
    finished: str,
    machine: str,
    results: dict[str, Any],
) -> dict[str, Any]:
    """The cache record of one finished cell: its settings (with the chat template as it was
    applied), where and when it ran, and the part of ``simple_evaluate``'s output worth
    keeping (:func:`summarize_results`)."""
    return {
        "format": CACHE_FORMAT,
        "config": key.config.name,
        "task": key.task,
        "limit": key.limit,
        "model_args": key.model_args,
        "gen_kwargs": key.gen_kwargs,
        "apply_chat_template": applied_chat_template,
        "wall_seconds": round(wall_seconds, 3),
        "finished": finished,
        "machine": machine,
        "summary": summarize_results(results, key.task),
    }


# --------------------------------------------------------------------------------------
# Reading lm-eval results
# --------------------------------------------------------------------------------------


def pick_metric(metrics: dict[str, Any]) -> tuple[str | None, float | None]:
    """Headline metric of one task entry of ``results["results"]`` (``name,filter`` keys)."""
    for wanted in PRIMARY_METRICS:
        for key, value in metrics.items():
            if key.split(",")[0] == wanted and isinstance(value, (int, float)):
                return key, float(value)
    return None, None


def sample_count(results: dict[str, Any], task: str) -> int:
    """Samples behind ``task``'s score: its own count, or the sum over a group's subtasks."""
    counts = results.get("n-samples", {})
    if task in counts:
        entry = counts[task]
        return int(entry.get("effective", entry.get("original", 0)))
    subtasks = results.get("group_subtasks", {}).get(task, [])
    return sum(sample_count(results, sub) for sub in subtasks)


def summarize_results(results: dict[str, Any], task: str) -> dict[str, Any]:
    """The JSON-safe part of ``simple_evaluate``'s output worth keeping for ``task``."""
    config = results.get("config", {})
    return {
        "results": results.get("results", {}),
        "groups": results.get("groups", {}),
        "group_subtasks": results.get("group_subtasks", {}),
        "n-samples": results.get("n-samples", {}),
        "safe_stats": config.get("safe_stats"),
        "drafter": config.get("drafter"),
        "members": config.get("members"),
        "safe_options": config.get("safe_options"),
        "n": sample_count(results, task),
    }


def samples_of(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-sample prompt/target/response/metrics, flattened over (sub)tasks, for inspection."""
    rows = []
    for task, samples in (results.get("samples") or {}).items():
        for sample in samples:
            resps = sample.get("filtered_resps") or sample.get("resps")
            rows.append(
                {
                    "task": task,
                    "doc_id": sample.get("doc_id"),
                    "target": sample.get("target"),
                    "response": resps[0] if isinstance(resps, list) and resps else resps,
                    **{k: sample[k] for k in ("exact_match", "math_equiv") if k in sample},
                }
            )
    return rows


def outcome_from_record(record: dict[str, Any], cached: bool) -> Outcome:
    """Turn a cache record into a table row."""
    task = record["task"]
    metric, accuracy = pick_metric(record["summary"]["results"].get(task, {}))
    stats = record["summary"].get("safe_stats") or {}
    return Outcome(
        config=record["config"],
        task=task,
        accuracy=accuracy,
        metric=metric,
        n=int(record["summary"].get("n", 0)),
        et_percent=stats.get("ensemble_rate_percent"),
        acceptance=stats.get("acceptance_rate"),
        tokens_per_second=stats.get("tokens_per_second"),
        generated_tokens=stats.get("generated_tokens"),
        wall_seconds=float(record["wall_seconds"]),
        cached=cached,
    )
