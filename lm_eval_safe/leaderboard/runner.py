"""Running the cells of a leaderboard that are not cached yet.

* Every configuration runs through the same public entry point a user would call,
  ``lm_eval.simple_evaluate(model="safe-ensemble", ...)``.
* One ``simple_evaluate`` per (configuration, task): each call loads fresh members, so the
  backend's ``safe_stats`` (E/T, acceptance, tokens/s -- docs/algorithm.md, Statistics) in
  ``results["config"]`` belong to exactly that task. Loading is cheap once GGUF weights are
  converted (the backend caches them).
* Loops are task-major (all configurations on task 1, then task 2, ...), so a partial run
  still yields complete comparisons for the tasks that finished.
* ``runner="cli"`` runs each cell as its own ``lm_eval`` process (what a GPU run wants: every
  cell starts with free GPU memory, and ``--use_cache`` lets a killed cell resume mid-task);
  a dry run prints those commands, exactly as they would run, and runs nothing.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lm_eval_safe
from lm_eval_safe.disk_cache import atomic_write_json
from lm_eval_safe.leaderboard.configs import Config, full_model_args
from lm_eval_safe.leaderboard.report import describe, machine_line
from lm_eval_safe.leaderboard.result_cache import (
    CellKey,
    Outcome,
    make_record,
    outcome_from_record,
    read_record,
    samples_of,
)


@dataclass
class RunSettings:
    """Everything that decides which cells run and how (the leaderboard's command line)."""

    tasks: list[str]
    limits: dict[str, float | int | None]
    out: Path
    max_gen_toks: int | None = None
    model_args_extra: str = ""
    alone_args: str = ""
    ensemble_args: str = ""
    apply_chat_template: bool = False
    data_dir: Path | None = None
    runner: str = "inprocess"  # or "cli": one lm_eval process per cell
    dry_run: bool = False
    report_only: bool = False
    save_samples: bool = False
    #: dry-run commands printed so far; shared by the leaderboards of one invocation so that a
    #: cell two member pairs have in common is printed once
    printed: set[str] = field(default_factory=set)

    def gen_kwargs(self) -> dict[str, Any]:
        """The generation kwargs every cell gets: only the budget, when one is given."""
        return {} if self.max_gen_toks is None else {"max_gen_toks": self.max_gen_toks}

    def metadata(self) -> dict[str, str]:
        """lm-eval task metadata: the local data folder, when one is used."""
        return {} if self.data_dir is None else {"data_dir": str(self.data_dir)}


def run_one(
    config: Config,
    task: str,
    settings: RunSettings,
    model_args: str,
    task_manager: Any,
    run_dir: Path | None = None,
) -> tuple[dict[str, Any], float, bool]:
    """One ``simple_evaluate`` call; returns (results, wall seconds incl. model loading,
    whether the chat template was applied). With ``run_dir`` the results and samples are also
    written there as ``lm_eval --output_path run_dir --log_samples`` writes them (the folder
    ``lm-eval-safe report`` reads, whichever runner ran the cell).

    With ``apply_chat_template`` a member alone that has no chat template (a base model)
    runs on the plain prompt: that is what it sees inside the ensemble (each member renders
    its own template, a member without one gets plain text), and the flag would otherwise stop
    the whole leaderboard at that cell."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.loggers import EvaluationTracker

    start = time.perf_counter()
    # built before the model: a trace=true member set writes its traces where the tracker puts samples
    tracker = None if run_dir is None else EvaluationTracker(output_path=str(run_dir))
    lm = get_model("safe-ensemble").create_from_arg_string(model_args)
    chat = settings.apply_chat_template and any(m.tokenizer.chat_template for m in lm.members)
    if settings.apply_chat_template and not chat:
        print(f"  {config.name}: no chat template; this cell runs on plain prompts", flush=True)
    results = lm_eval.simple_evaluate(
        model=lm,
        model_args=model_args,  # not used to build lm: names its output folder and results
        tasks=[task],
        limit=settings.limits[task],
        task_manager=task_manager,
        gen_kwargs=settings.gen_kwargs() or None,
        apply_chat_template=chat,
        log_samples=settings.save_samples,
        bootstrap_iters=0,
        evaluation_tracker=tracker,
    )
    wall = time.perf_counter() - start
    if results is None:  # non-zero rank in a distributed run
        raise SystemExit("simple_evaluate returned nothing (not rank 0?)")
    if tracker is not None:  # what lm_eval's CLI does after simple_evaluate
        # the CLI's tracker names the model by its registry name; given the object itself,
        # lm-eval 0.4.9 deep-copies it into the results and fails to save them (open files)
        tracker.general_config_tracker.model_source = "safe-ensemble"
        samples = results.get("samples") or {}
        tracker.save_results_aggregated(results=results, samples=samples or None)
        for task_name in results.get("configs", {}):
            if task_name in samples:
                tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    return results, wall, chat


def lm_eval_command(task: str, settings: RunSettings, model_args: str, run_dir: Path) -> list[str]:
    """The ``lm_eval`` command of one cell, as ``runner="cli"`` runs it (a dry run prints it).

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
        lm_eval_safe.task_dir(),
        "--output_path",
        str(run_dir),
        "--use_cache",
        str(run_dir / "requests"),
    ]
    if settings.data_dir is not None:
        command += ["--metadata", json.dumps(settings.metadata())]
    if settings.limits[task] is not None:
        command += ["--limit", f"{settings.limits[task]:g}"]
    if gen_kwargs := settings.gen_kwargs():
        command += ["--gen_kwargs", ",".join(f"{k}={v}" for k, v in gen_kwargs.items())]
    if settings.apply_chat_template:
        command.append("--apply_chat_template")
    if settings.save_samples:
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


class _LazyTaskManager:
    """lm-eval's task index, built on first use: indexing lm-eval's tasks takes seconds, and a
    resumed or dry run may need none."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self._metadata = metadata
        self._manager: Any = None

    def get(self) -> Any:
        if self._manager is None:
            from lm_eval.tasks import TaskManager

            self._manager = TaskManager(
                include_path=lm_eval_safe.task_dir(), metadata=self._metadata
            )
        return self._manager


def traced_model_args(config: Config, model_args: str, settings: RunSettings) -> str:
    """Ensembles whose samples are kept also write traces (``trace=true``): the HTML report
    marks their ensemble points. Traces change no output, so the cell's cache key omits it."""
    if config.is_single or not settings.save_samples:
        return model_args
    return f"{model_args},trace=true"


def cell_run_dir(config: Config, task: str, settings: RunSettings) -> Path:
    """The lm-eval output folder of one cell (results, samples and traces)."""
    return _cell_key(config, task, settings)[1]


def _cell_key(config: Config, task: str, settings: RunSettings) -> tuple[CellKey, Path, str]:
    model_args = full_model_args(
        config, settings.model_args_extra, settings.alone_args, settings.ensemble_args
    )
    key = CellKey(
        config,
        task,
        settings.limits[task],
        model_args,
        settings.gen_kwargs(),
        settings.apply_chat_template,
    )
    path = key.path(settings.out)
    return key, path.parent.parent / "lm_eval" / path.stem, model_args


def _run_cell(
    config: Config, task: str, settings: RunSettings, tag: str, task_managers: _LazyTaskManager
) -> Outcome | None:
    """One cell: read from the cache, print its command (dry run), skip it (report only), or
    run it and cache its record at once. None when the cell has no result."""
    key, run_dir, model_args = _cell_key(config, task, settings)
    path = key.path(settings.out)
    run_args = traced_model_args(config, model_args, settings)
    command = lm_eval_command(task, settings, run_args, run_dir)
    if path.is_file():
        outcome = outcome_from_record(read_record(path), cached=True)
        note = "# " if settings.dry_run else ""
        print(f"{note}{tag}: cached ({path.name}) {describe(outcome)}", flush=True)
        return outcome
    if settings.dry_run:
        line = shlex.join(command)  # a command shared by two pairs is printed once
        seen = line in settings.printed
        print(f"# {tag}" + (": as above" if seen else f"\n{line}"), flush=True)
        settings.printed.add(line)
        return None
    if settings.report_only:
        print(f"{tag}: not run yet (--report-only)", flush=True)
        return None
    print(f"{tag}: start (model_args={model_args})", flush=True)
    chat = settings.apply_chat_template
    if settings.runner == "cli":
        results, wall = run_cli(command, run_dir)
    else:
        folder = run_dir if settings.save_samples else None
        results, wall, chat = run_one(config, task, settings, run_args, task_managers.get(), folder)
    record = make_record(
        key,
        chat,
        wall,
        finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        machine=machine_line(),
        results=results,
    )
    if settings.save_samples and settings.runner != "cli":  # cli: lm_eval's samples_*.jsonl
        atomic_write_json(path.with_suffix(".samples.json"), samples_of(results), indent=2)
    atomic_write_json(path, record, indent=2)
    outcome = outcome_from_record(record, cached=False)
    print(f"{tag}: done in {wall:.1f}s {describe(outcome)}", flush=True)
    return outcome


def run_all(settings: RunSettings, configs: list[Config]) -> list[Outcome]:
    """Run or load every (task, configuration), task-major, printing a line per step."""
    outcomes: list[Outcome] = []
    task_managers = _LazyTaskManager(settings.metadata())
    total = len(configs) * len(settings.tasks)
    step = 0
    for task in settings.tasks:
        for config in configs:
            step += 1
            tag = f"[{step}/{total}] {config.name} on {task}"
            outcome = _run_cell(config, task, settings, tag, task_managers)
            if outcome is not None:
                outcomes.append(outcome)
    return outcomes
