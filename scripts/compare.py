#!/usr/bin/env python3
"""Leaderboard: members alone vs. ensembles (SAFE and its baselines) on the paper's tasks.

Why it is built this way
------------------------
* Every configuration runs through the same public entry point a user would call,
  ``lm_eval.simple_evaluate(model="safe-ensemble", ...)``. A member "alone" is
  ``members=<that member>``, i.e. the identical decoder loop with one model, so the
  comparison measures ensembling and nothing else (prompting, stopping and answer checking
  are shared).
* One ``simple_evaluate`` per (configuration, task): each call loads fresh members, so the
  backend's ``safe_stats`` (E/T, acceptance, tokens/s -- SAFE_SPEC §8) in
  ``results["config"]`` belong to exactly that task. Loading is cheap once GGUF weights are
  converted (the backend caches them).
* Runs on a CPU take minutes to hours, so every finished (configuration, task, limit) is
  written at once to its own JSON file in ``--out`` (atomically). A second invocation with
  the same settings reads those files and runs only what is missing: an interrupted run
  resumes. The file name carries a hash of everything that changes the numbers (members,
  model_args, generation budget, chat template, limit), so changing a setting never reuses
  a stale result.
* Loops are task-major (all configurations on task 1, then task 2, ...), so a partial run
  still yields complete comparisons for the tasks that finished.
* The table prints accuracy with the gap to the best single member as the paper does
  (``76.0 (+1.2)``), plus a 95% Wilson interval from the sample count: on small subsets the
  interval is what tells whether a gap means anything.

* ``--runner cli`` runs each cell as its own ``lm_eval`` process (what a GPU run wants: every
  cell starts with free GPU memory, and ``--use_cache`` lets a killed cell resume mid-task);
  ``--dry-run`` prints those commands, exactly as they would run, and runs nothing.
* ``--preset paper`` is the SAFE paper's Table 2 on GPUs: its two pairs of 7-8B instruct models
  by hub id, members alone, UniTE, UniTE+SAFE, GaC and GaC+SAFE on MATH-500, GSM8K and the
  15 BBH subjects, 2048 new tokens, bf16, one GPU per member, with the paper's number printed
  beside each measured cell (SAFE_SPEC §10).

Example (GSM8K subset, all built-in configurations)::

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python scripts/compare.py \\
        --members smollm2-135m,gemma3-270m --tasks safe_gsm8k --limit 10 \\
        --max-gen-toks 256 --out benchmarks/runs/leaderboard

The paper's table (two GPUs; ``--dry-run`` first to see the commands)::

    .venv/bin/python scripts/compare.py --preset paper --dry-run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO_ROOT / "tasks"
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
DEFAULT_TASKS = ("safe_gsm8k", "safe_math500", "safe_bbh_paper")
#: Bump when the layout of a cache file changes, so old files are not misread.
CACHE_FORMAT = 1
#: Metrics in order of preference for the headline accuracy of a task. ``math_equiv``
#: (symbolic equivalence) is what the paper's MATH numbers correspond to; the others
#: report ``exact_match``.
PRIMARY_METRICS = ("math_equiv", "exact_match")

#: Built-in ensemble configurations: name -> model_args (members are added in front).
#: Names follow the paper's method names; "alone" rows are generated per member.
ENSEMBLE_CONFIGS: dict[str, str] = {
    "gac-threshold": "schedule=threshold,aggregator=gac",
    "unite-every": "schedule=every,aggregator=unite",
    "gac-safe": "schedule=safe,aggregator=gac",
    "unite-safe": "schedule=safe,aggregator=unite",
    "unite-safe-sharpen-none": "schedule=safe,aggregator=unite,sharpen=none",
    "unite-safe-sharpen-geometric": "schedule=safe,aggregator=unite,sharpen=geometric",
    "gac-safe-sharpen-none": "schedule=safe,aggregator=gac,sharpen=none",
    "gac-safe-sharpen-geometric": "schedule=safe,aggregator=gac,sharpen=geometric",
}
ALONE_PREFIX = "alone:"


@dataclass(frozen=True)
class PaperPair:
    """One member pair of the SAFE paper's Table 2 and the numbers the paper reports for it."""

    name: str
    members: tuple[str, ...]  # hub ids; the first one drafts (see README, "Reproduce the paper")
    accuracy: dict[tuple[str, str], float]  # (configuration, task) -> accuracy in %
    et_math500: dict[str, float]  # configuration -> E/T % on MATH-500


#: Table 2 configurations: each member alone, then UniTE (every token), UniTE+SAFE, GaC (its
#: 0.5 threshold gate) and GaC+SAFE. ``alone`` expands to one row per member.
PAPER_CONFIGS = ("alone", "unite-every", "unite-safe", "gac-threshold", "gac-safe")
PAPER_LABELS = {
    "unite-every": "UniTE",
    "unite-safe": "UniTE+SAFE",
    "gac-threshold": "GaC",
    "gac-safe": "GaC+SAFE",
}
PAPER_TASKS = ("safe_math500", "safe_gsm8k", "safe_bbh_paper")
_INTERNLM3, _QWEN25, _EXAONE35 = (
    "internlm/internlm3-8b-instruct",
    "Qwen/Qwen2.5-7B-Instruct",
    "LGAI-EXAONE/EXAONE-3.5-7.8B-Instruct",
)
#: The numbers of SAFE_SPEC §10 (the paper's Table 2, greedy, one GPU per model). The spec gives
#: the best single model (Internlm3) but not Qwen2.5 alone, and no numbers for the second pair:
#: those cells print no paper number rather than an invented one.
PAPER_PAIRS: tuple[PaperPair, ...] = (
    PaperPair(
        name="internlm3-8b+qwen2.5-7b",
        members=(_INTERNLM3, _QWEN25),
        accuracy={
            **{
                (f"{ALONE_PREFIX}internlm3-8b-instruct", t): v
                for t, v in zip(PAPER_TASKS, (74.8, 90.14, 82.26), strict=True)
            },
            **{
                ("gac-threshold", t): v
                for t, v in zip(PAPER_TASKS, (74.2, 91.28, 82.34), strict=True)
            },
            **{("gac-safe", t): v for t, v in zip(PAPER_TASKS, (76.0, 91.36, 82.34), strict=True)},
            **{
                ("unite-every", t): v
                for t, v in zip(PAPER_TASKS, (59.6, 75.06, 79.58), strict=True)
            },
            **{
                ("unite-safe", t): v for t, v in zip(PAPER_TASKS, (77.4, 92.04, 82.97), strict=True)
            },
        },
        et_math500={
            "gac-threshold": 1.04,
            "gac-safe": 0.71,
            "unite-every": 100.0,
            "unite-safe": 3.82,
        },
    ),
    PaperPair(
        name="qwen2.5-7b+exaone3.5-7.8b", members=(_QWEN25, _EXAONE35), accuracy={}, et_math500={}
    ),
)
#: Settings of the paper's runs: 2048 new tokens, bf16, each member on its own GPU (a member
#: alone on the first), chat templates (instruct models), and remote code, which the
#: Internlm3 and EXAONE-3.5 checkpoints need.
PAPER_SETTINGS = {
    "max_gen_toks": 2048,
    "model_args_extra": "dtype=bfloat16,trust_remote_code=true",
    "alone_args": "device=cuda:0",
    "ensemble_args": "member_devices=cuda:0|cuda:1",
}


@dataclass(frozen=True)
class Config:
    """One row of the leaderboard: a name and the model_args that produce it."""

    name: str
    model_args: str
    is_single: bool


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


# --------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------


def member_name(spec: str) -> str:
    """Display name of a member spec: the alias, or the file/folder name (as the backend)."""
    stripped = spec.rstrip("/\\")
    if "/" in stripped or "\\" in stripped:
        name = Path(stripped).name
        return name[: -len(".gguf")] if name.endswith(".gguf") else name
    return stripped


def build_configs(members: Sequence[str], names: Sequence[str] | None) -> list[Config]:
    """Expand ``--configs`` into rows; ``alone`` means every member alone, ``all`` everything.

    Members alone come first because the gap column of every other row refers to them.
    """
    alone = {
        ALONE_PREFIX + member_name(m): Config(ALONE_PREFIX + member_name(m), f"members={m}", True)
        for m in members
    }
    joined = "|".join(members)
    ensembles = {
        name: Config(name, f"members={joined},{args}", False)
        for name, args in ENSEMBLE_CONFIGS.items()
    }
    if not names or list(names) == ["all"]:
        return [*alone.values(), *ensembles.values()]
    chosen: list[Config] = []
    for name in names:
        if name == "all":
            picks = [*alone.values(), *ensembles.values()]
        elif name == "alone":
            picks = list(alone.values())
        elif name in alone:
            picks = [alone[name]]
        elif ALONE_PREFIX + name in alone:
            picks = [alone[ALONE_PREFIX + name]]
        elif name in ensembles:
            picks = [ensembles[name]]
        else:
            known = ", ".join(["all", "alone", *alone, *ensembles])
            raise SystemExit(f"--configs: unknown configuration {name!r}; known: {known}")
        chosen.extend(p for p in picks if p not in chosen)
    singles = [c for c in chosen if c.is_single]
    return singles + [c for c in chosen if not c.is_single]


def full_model_args(config: Config, extra: str, alone: str = "", ensemble: str = "") -> str:
    """Configuration model_args plus ``--model-args-extra`` (e.g. ``device=cpu``) and the extra
    of its kind (``--alone-args`` for a member alone, ``--ensemble-args`` for an ensemble: one
    GPU for a model alone, ``member_devices`` for a pair)."""
    parts = [config.model_args, alone if config.is_single else ensemble, extra]
    return ",".join(p for p in parts if p)


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def slug(text: str) -> str:
    """File-name-safe form of a configuration or task name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def cache_path(
    out: Path,
    config: Config,
    task: str,
    limit: float | None,
    model_args: str,
    gen_kwargs: dict[str, Any],
    apply_chat_template: bool,
) -> Path:
    """``<out>/cache/<config>__<task>__limit<N>__<hash>.json``; the hash covers the settings."""
    key = json.dumps(
        {
            "format": CACHE_FORMAT,
            "model_args": model_args,
            "task": task,
            "limit": limit,
            "gen_kwargs": gen_kwargs,
            "apply_chat_template": apply_chat_template,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    limit_part = "all" if limit is None else f"{limit:g}"
    return out / "cache" / f"{slug(config.name)}__{slug(task)}__limit{limit_part}__{digest}.json"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write via a private temporary file, fsync and rename (lm_eval_safe.disk_cache), so an
    interrupted run never leaves half a file and two runs never write into one temporary."""
    from lm_eval_safe.disk_cache import atomic_write_bytes

    text = json.dumps(data, indent=2, default=str, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


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


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def run_one(
    config: Config,
    task: str,
    args: argparse.Namespace,
    model_args: str,
    gen_kwargs: dict[str, Any],
    task_manager: Any,
) -> tuple[dict[str, Any], float, bool]:
    """One ``simple_evaluate`` call; returns (results, wall seconds incl. model loading,
    whether the chat template was applied).

    With ``--apply-chat-template`` a member alone that has no chat template (a base model)
    runs on the plain prompt: that is what it sees inside the ensemble (each member renders
    its own template, a member without one gets plain text), and the flag would otherwise stop
    the whole leaderboard at that cell."""
    import lm_eval
    from lm_eval.api.registry import get_model

    start = time.perf_counter()
    lm = get_model("safe-ensemble").create_from_arg_string(model_args)
    chat = args.apply_chat_template and any(
        getattr(m.tokenizer, "chat_template", None) for m in lm.members
    )
    if args.apply_chat_template and not chat:
        print(f"  {config.name}: no chat template; this cell runs on plain prompts", flush=True)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=[task],
        limit=args.limits[task],
        task_manager=task_manager,
        gen_kwargs=gen_kwargs or None,
        apply_chat_template=chat,
        log_samples=args.save_samples,
        bootstrap_iters=0,
    )
    wall = time.perf_counter() - start
    if results is None:  # non-zero rank in a distributed run
        raise SystemExit("simple_evaluate returned nothing (not rank 0?)")
    return results, wall, chat


def lm_eval_command(
    task: str,
    args: argparse.Namespace,
    model_args: str,
    gen_kwargs: dict[str, Any],
    run_dir: Path,
) -> list[str]:
    """The ``lm_eval`` command of one cell, as ``--runner cli`` runs it (``--dry-run`` prints it).

    Results go to ``run_dir``; ``--use_cache`` there lets a killed run resume where it stopped."""
    command = [
        "lm_eval",
        "--model",
        "safe-ensemble",
        "--model_args",
        model_args,
        "--tasks",
        task,
        "--include_path",
        str(TASKS_DIR),
        "--output_path",
        str(run_dir),
        "--use_cache",
        str(run_dir / "requests"),
    ]
    if args.data_dir is not None:
        command += ["--metadata", json.dumps({"data_dir": str(args.data_dir)})]
    if args.limits[task] is not None:
        command += ["--limit", f"{args.limits[task]:g}"]
    if gen_kwargs:
        command += ["--gen_kwargs", ",".join(f"{k}={v}" for k, v in gen_kwargs.items())]
    if args.apply_chat_template:
        command.append("--apply_chat_template")
    if args.save_samples:
        command.append("--log_samples")
    return command


def run_cli(command: list[str], run_dir: Path) -> tuple[dict[str, Any], float]:
    """Run one cell's ``lm_eval`` command (this environment's ``lm_eval``); its results JSON."""
    program = Path(sys.executable).with_name("lm_eval")
    argv = [str(program) if program.is_file() else "lm_eval", *command[1:]]
    start = time.perf_counter()
    code = subprocess.run(argv, check=False).returncode
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"lm_eval failed (exit {code}): {shlex.join(command)}")
    found = sorted(run_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"lm_eval wrote no results_*.json under {run_dir}")
    return json.loads(found[-1].read_text()), wall


def run_all(args: argparse.Namespace, configs: list[Config]) -> list[Outcome]:
    """Run or load every (task, configuration), task-major, printing a line per step."""
    gen_kwargs: dict[str, Any] = {}
    if args.max_gen_toks is not None:
        gen_kwargs["max_gen_toks"] = args.max_gen_toks
    outcomes: list[Outcome] = []
    task_manager = None  # built on first use: indexing lm-eval's tasks takes seconds
    total = len(configs) * len(args.tasks)
    step = 0
    for task in args.tasks:
        for config in configs:
            step += 1
            model_args = full_model_args(
                config, args.model_args_extra, args.alone_args, args.ensemble_args
            )
            path = cache_path(
                args.out,
                config,
                task,
                args.limits[task],
                model_args,
                gen_kwargs,
                args.apply_chat_template,
            )
            tag = f"[{step}/{total}] {config.name} on {task}"
            run_dir = path.parent.parent / "lm_eval" / path.stem
            command = lm_eval_command(task, args, model_args, gen_kwargs, run_dir)
            if path.is_file():
                record = json.loads(path.read_text())
                outcome = outcome_from_record(record, cached=True)
                note = "# " if args.dry_run else ""
                print(f"{note}{tag}: cached ({path.name}) {describe(outcome)}", flush=True)
                outcomes.append(outcome)
                continue
            if args.dry_run:
                printed: set[str] = vars(args).setdefault("printed", set())
                line = shlex.join(command)  # a command shared by two pairs is printed once
                print(f"# {tag}" + (": as above" if line in printed else f"\n{line}"), flush=True)
                printed.add(line)
                continue
            if args.report_only:
                print(f"{tag}: not run yet (--report-only)", flush=True)
                continue
            print(f"{tag}: start (model_args={model_args})", flush=True)
            chat = args.apply_chat_template
            if args.runner == "cli":
                results, wall = run_cli(command, run_dir)
            else:
                if task_manager is None:
                    from lm_eval.tasks import TaskManager

                    metadata = {} if args.data_dir is None else {"data_dir": str(args.data_dir)}
                    task_manager = TaskManager(include_path=str(TASKS_DIR), metadata=metadata)
                results, wall, chat = run_one(
                    config, task, args, model_args, gen_kwargs, task_manager
                )
            record = {
                "format": CACHE_FORMAT,
                "config": config.name,
                "task": task,
                "limit": args.limits[task],
                "model_args": model_args,
                "gen_kwargs": gen_kwargs,
                "apply_chat_template": chat,
                "wall_seconds": round(wall, 3),
                "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "machine": machine_line(),
                "summary": summarize_results(results, task),
            }
            if args.save_samples and args.runner != "cli":  # cli: lm_eval's samples_*.jsonl
                samples_path = path.with_suffix(".samples.json")
                write_json_atomic(samples_path, samples_of(results))
            write_json_atomic(path, record)
            outcome = outcome_from_record(record, cached=False)
            print(f"{tag}: done in {wall:.1f}s {describe(outcome)}", flush=True)
            outcomes.append(outcome)
    return outcomes


def describe(outcome: Outcome) -> str:
    """One progress line: accuracy, n, E/T."""
    acc = "n/a" if outcome.accuracy is None else f"{100 * outcome.accuracy:.1f}%"
    et = "" if outcome.et_percent is None else f" E/T={outcome.et_percent:.2f}%"
    return f"acc={acc} n={outcome.n}{et}"


def machine_line() -> str:
    """Short description of where the numbers were measured."""
    try:
        import torch

        threads = torch.get_num_threads()
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except Exception:  # noqa: BLE001 - describing the machine must never fail a run
        threads, device = -1, "unknown"
    return f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch threads {threads}, {device}"


# --------------------------------------------------------------------------------------
# Table and plot
# --------------------------------------------------------------------------------------


def wilson_interval(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: sane at n of a few and at p = 0 or 1."""
    if n <= 0:
        return 0.0, 1.0
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def best_single(outcomes: Sequence[Outcome], configs: Sequence[Config], task: str) -> float | None:
    """Accuracy of the best member alone on ``task`` (None when no member-alone row ran)."""
    singles = {c.name for c in configs if c.is_single}
    values = [
        o.accuracy
        for o in outcomes
        if o.task == task and o.config in singles and o.accuracy is not None
    ]
    return max(values) if values else None


def accuracy_cell(
    outcome: Outcome | None, best: float | None, is_single: bool, paper: float | None = None
) -> str:
    """``76.0 (+1.2)``: accuracy in %, gap in points to the best member (ensembles only); with
    the paper's number for the cell, ``76.0 (+1.2) [paper 77.4]``."""
    if outcome is None or outcome.accuracy is None:
        text = "-"
    else:
        text = f"{100 * outcome.accuracy:.1f}"
        if best is not None and not is_single:
            text += f" ({100 * (outcome.accuracy - best):+.1f})"
    return text if paper is None else f"{text} [paper {paper}]"


def row_label(config: Config, paper: PaperPair | None) -> str:
    """A configuration's row name; in a paper table with the paper's method name beside it."""
    label = PAPER_LABELS.get(config.name) if paper is not None else None
    return f"{config.name} ({label})" if label else config.name


def fmt(value: float | None, pattern: str) -> str:
    """Format or dash."""
    return "-" if value is None else pattern.format(value)


def markdown_table(
    outcomes: Sequence[Outcome],
    configs: Sequence[Config],
    tasks: Sequence[str],
    paper: PaperPair | None = None,
) -> str:
    """Overview (config x task accuracy, paper layout) and one detail table per task; with
    ``paper``, the paper's accuracy (and MATH-500 E/T) beside each cell it reports."""
    by_key = {(o.config, o.task): o for o in outcomes}
    reported = paper.accuracy if paper is not None else {}
    lines = [
        "Accuracy in % (gap to the best member alone, in points). Metric: "
        + ", ".join(
            f"{t}: {next((o.metric for o in outcomes if o.task == t and o.metric), '-')}"
            for t in tasks
        )
        + ".",
        "",
        "| configuration | " + " | ".join(tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for config in configs:
        cells = [
            accuracy_cell(
                by_key.get((config.name, t)),
                best_single(outcomes, configs, t),
                config.is_single,
                reported.get((config.name, t)),
            )
            for t in tasks
        ]
        lines.append(f"| {row_label(config, paper)} | " + " | ".join(cells) + " |")
    for task in tasks:
        best = best_single(outcomes, configs, task)
        lines += [
            "",
            f"### {task}",
            "",
            "| configuration | accuracy % (gap) | 95% CI (Wilson) | n | E/T % | acceptance | tokens | tok/s | wall s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for config in configs:
            o = by_key.get((config.name, task))
            paper_acc = reported.get((config.name, task))
            paper_et = (
                paper.et_math500.get(config.name) if paper and task == "safe_math500" else None
            )
            if o is None:
                cell = "not run" + ("" if paper_acc is None else f" [paper {paper_acc}]")
                et = "-" if paper_et is None else f"- [paper {paper_et}]"
                lines.append(
                    f"| {row_label(config, paper)} | {cell} | - | - | {et} | - | - | - | - |"
                )
                continue
            if o.accuracy is not None and o.n:
                lo, hi = wilson_interval(o.accuracy, o.n)
                ci = f"[{100 * lo:.1f}, {100 * hi:.1f}]"
            else:
                ci = "-"
            et = fmt(o.et_percent, "{:.2f}") + ("" if paper_et is None else f" [paper {paper_et}]")
            lines.append(
                f"| {row_label(config, paper)} | {accuracy_cell(o, best, config.is_single, paper_acc)} "
                f"| {ci} | {o.n} | {et} | {fmt(o.acceptance, '{:.3f}')} | "
                f"{fmt(o.generated_tokens, '{:d}')} | {fmt(o.tokens_per_second, '{:.2f}')} | "
                f"{o.wall_seconds:.0f} |"
            )
    return "\n".join(lines) + "\n"


def plot(
    outcomes: Sequence[Outcome], configs: Sequence[Config], tasks: Sequence[str], path: Path
) -> None:
    """Grouped bars: accuracy with Wilson intervals (left), E/T on a symlog axis (right).

    E/T spans 0% (members alone) to 100% (every-token), with SAFE at a few %: a symlog
    axis keeps both ends readable.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = {(o.config, o.task): o for o in outcomes}
    names = [c.name for c in configs]
    width = 0.8 / max(1, len(tasks))
    fig, (ax_acc, ax_et) = plt.subplots(
        1, 2, figsize=(max(10.0, 1.2 * len(names) * 2), 5.0), constrained_layout=True
    )
    for i, task in enumerate(tasks):
        xs, acc, err_lo, err_hi, et = [], [], [], [], []
        for j, name in enumerate(names):
            o = by_key.get((name, task))
            xs.append(j + (i - (len(tasks) - 1) / 2) * width)
            if o is None or o.accuracy is None:
                acc.append(math.nan)
                err_lo.append(0.0)
                err_hi.append(0.0)
            else:
                lo, hi = wilson_interval(o.accuracy, o.n)
                acc.append(100 * o.accuracy)
                err_lo.append(100 * (o.accuracy - lo))
                err_hi.append(100 * (hi - o.accuracy))
            et.append(math.nan if o is None or o.et_percent is None else o.et_percent)
        ax_acc.bar(xs, acc, width, yerr=[err_lo, err_hi], capsize=2, label=task)
        ax_et.bar(xs, et, width, label=task)
    for ax in (ax_acc, ax_et):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    ax_acc.set_ylabel("accuracy % (95% Wilson CI)")
    ax_acc.set_ylim(0, 100)
    ax_acc.set_title("Accuracy")
    ax_et.set_yscale("symlog", linthresh=1.0)
    ax_et.set_ylim(0, 100)
    ax_et.set_ylabel("E/T % (ensembled / generated tokens)")
    ax_et.set_title("Ensembled tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _number(text: str) -> float | int:
    """lm-eval's limit: an int sample count, or a fraction below 1."""
    value = float(text)
    return int(value) if value >= 1 else value


def parse_limits(text: str | None, tasks: Sequence[str]) -> dict[str, float | int | None]:
    """``--limit``: one number for all tasks, or ``task=N`` pairs (one budget per task)."""
    if text is None:
        return dict.fromkeys(tasks)
    if "=" not in text:
        return dict.fromkeys(tasks, _number(text))
    limits: dict[str, float | int | None] = dict.fromkeys(tasks)
    for part in text.split(","):
        task, _, value = part.partition("=")
        if task not in limits:
            raise SystemExit(f"--limit: {task!r} is not one of --tasks ({', '.join(tasks)})")
        limits[task] = _number(value)
    return limits


PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "tasks": ",".join(PAPER_TASKS),
        "configs": ",".join(PAPER_CONFIGS),
        "max_gen_toks": PAPER_SETTINGS["max_gen_toks"],
        "model_args_extra": PAPER_SETTINGS["model_args_extra"],
        "alone_args": PAPER_SETTINGS["alone_args"],
        "ensemble_args": PAPER_SETTINGS["ensemble_args"],
        "apply_chat_template": True,
        "runner": "cli",
        "out": REPO_ROOT / "benchmarks" / "runs" / "paper",
    },
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring for an example). A ``--preset`` sets
    defaults; options given explicitly still win."""
    parser = argparse.ArgumentParser(
        description="Members alone vs. SAFE and baseline ensembles on lm-eval tasks; "
        "resumable (results cached per configuration+task+limit in --out).",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="paper: the SAFE paper's Table 2 (its two model pairs by hub id, 2 GPUs); "
        "--members is then not used",
    )
    parser.add_argument(
        "--members", default=None, help="comma list of member specs (aliases, paths)"
    )
    parser.add_argument(
        "--tasks", default=",".join(DEFAULT_TASKS), help="comma list of tasks or groups"
    )
    parser.add_argument(
        "--limit",
        default=None,
        help="samples per (sub)task: N for every task, or per task, e.g. "
        "safe_gsm8k=10,safe_math500=5,safe_bbh_paper=1 (tasks not named: all samples)",
    )
    parser.add_argument(
        "--configs",
        default="all",
        help="comma list: all, alone, alone:<member> (or <member>), " + ", ".join(ENSEMBLE_CONFIGS),
    )
    parser.add_argument("--max-gen-toks", type=int, default=None, help="generation budget override")
    parser.add_argument(
        "--data-dir",
        default=None,
        help=f"local data folder (default: {DEFAULT_DATA_DIR} if it exists); 'hub' (or no local "
        "folder): the tasks download their hub datasets",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks" / "runs" / "leaderboard"
    )
    parser.add_argument(
        "--model-args-extra", default="", help="appended to every model_args, e.g. device=cpu"
    )
    parser.add_argument(
        "--alone-args",
        default="",
        help="appended to the model_args of members alone, e.g. device=cuda:0",
    )
    parser.add_argument(
        "--ensemble-args",
        default="",
        help="appended to the model_args of ensembles, e.g. member_devices=cuda:0|cuda:1",
    )
    parser.add_argument(
        "--apply-chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="render prompts with each member's own chat template (instruct models)",
    )
    parser.add_argument(
        "--runner",
        choices=("inprocess", "cli"),
        default="inprocess",
        help="inprocess: simple_evaluate in this process; cli: one lm_eval process per cell "
        "(fresh GPU memory per cell, --use_cache resumes a killed cell)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the lm_eval command of every cell not cached yet, exactly as --runner cli "
        "runs it, and the table with what is cached; run nothing",
    )
    parser.add_argument(
        "--save-samples",
        action="store_true",
        help="also keep each run's responses (<name>.samples.json; with --runner cli, lm_eval's "
        "samples_*.jsonl next to its results)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: write the table and plot from the cached results (partial runs)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads; 1 avoids oversubscription when other jobs share the CPU",
    )
    parser.add_argument("--markdown", type=Path, default=None, help="default: <out>/leaderboard.md")
    parser.add_argument("--plot", type=Path, default=None, help="default: <out>/leaderboard.png")
    preset = parser.parse_known_args(argv)[0].preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    if preset is None and not args.members:
        raise SystemExit("--members: give at least one member (or --preset paper)")
    if preset is not None and args.members:
        raise SystemExit(f"--preset {preset} names its own members; drop --members")
    args.members = [m for m in (args.members or "").split(",") if m]
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.configs = [c for c in args.configs.split(",") if c]
    args.limits = parse_limits(args.limit, args.tasks)
    if args.data_dir == "hub":
        args.data_dir = None
    elif args.data_dir is not None:
        args.data_dir = Path(args.data_dir).resolve()
    elif DEFAULT_DATA_DIR.is_dir():
        args.data_dir = DEFAULT_DATA_DIR.resolve()
    args.out = args.out.resolve()
    args.markdown = args.markdown or args.out / "leaderboard.md"
    args.plot = args.plot or args.out / "leaderboard.png"
    return args


def leaderboard(args: argparse.Namespace, paper: PaperPair | None = None) -> str:
    """Run (or resume) one member set's leaderboard and write its table and plot; with
    ``--dry-run`` print the commands instead and return the table of what is cached."""
    configs = build_configs(args.members, args.configs)
    note = "# " if args.dry_run else ""
    print(
        f"{note}compare: {len(configs)} configurations x {len(args.tasks)} tasks, "
        f"limits={args.limits}, out={args.out}",
        flush=True,
    )
    outcomes = run_all(args, configs)
    table = markdown_table(outcomes, configs, args.tasks, paper)
    if args.dry_run:
        return table
    header = (
        f"# Leaderboard\n\nmembers: {', '.join(args.members)}; limit per (sub)task: {args.limits}; "
        f"max_gen_toks: {args.max_gen_toks}; chat template: {args.apply_chat_template}; "
        f"extra model_args: {args.model_args_extra or '-'}\n\n"
    )
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(header + table)
    plot(outcomes, configs, args.tasks, args.plot)
    print(table, flush=True)
    print(f"wrote {args.markdown} and {args.plot}", flush=True)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or resume) the leaderboard(s), then write the markdown table(s) and the PNG(s)."""
    args = parse_args(argv)
    args.printed = set()  # dry-run commands printed so far, shared by the pairs of a preset
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.preset != "paper":
        table = leaderboard(args)
        if args.dry_run:
            print("".join(f"# {line}\n" for line in table.splitlines()), end="", flush=True)
        return 0
    for pair in PAPER_PAIRS:
        # one --out for both pairs: Qwen2.5 alone is in both and runs (and is cached) once
        pair_args = argparse.Namespace(**vars(args))
        pair_args.members = list(pair.members)
        pair_args.markdown = args.out / f"leaderboard_{pair.name}.md"
        pair_args.plot = args.out / f"leaderboard_{pair.name}.png"
        drafter = member_name(pair.members[0])
        pair_args.ensemble_args = ",".join(
            a for a in (f"drafter={drafter}", args.ensemble_args) if a
        )
        numbers = (
            "paper numbers: SAFE_SPEC §10" if pair.accuracy else "no paper numbers in SAFE_SPEC"
        )
        print(
            f"# {pair.name}: {' + '.join(pair.members)}, drafter {drafter}; {numbers}", flush=True
        )
        table = leaderboard(pair_args, pair)
        if args.dry_run:
            print("".join(f"# {line}\n" for line in table.splitlines()), end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
