"""``lm-eval-safe leaderboard``: members alone vs. ensembles (SAFE and its baselines) on the paper's tasks.

The command line of :mod:`lm_eval_safe.leaderboard`: every configuration runs through
``lm_eval.simple_evaluate(model="safe-ensemble", ...)`` (a member "alone" is the same decoder
with one model), one cell per (configuration, task), each cached in ``--out`` the moment it
finishes so that an interrupted run resumes; the table prints accuracy with the gap to the best
member alone and a 95% Wilson interval, then E/T, acceptance and speed per cell.

* ``--runner cli`` runs each cell as its own ``lm_eval`` process (what a GPU run wants: every
  cell starts with free GPU memory, and ``--use_cache`` lets a killed cell resume mid-task);
  ``--dry-run`` prints those commands, exactly as they would run, and runs nothing.
* ``--preset paper`` is the SAFE paper's Table 2 on GPUs: its two pairs of 7-8B instruct models
  by hub id, members alone, UniTE, UniTE+SAFE, GaC and GaC+SAFE on MATH-500, GSM8K and the
  15 BBH subjects, 2048 new tokens, bf16, one GPU per member, with the paper's number printed
  beside each measured cell (docs/algorithm.md, The paper's numbers).

Example (GSM8K subset, all built-in configurations)::

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/lm-eval-safe leaderboard \\
        --members smollm2-135m,gemma3-270m --tasks safe_gsm8k --limit 10 \\
        --max-gen-toks 256 --out benchmarks/runs/leaderboard

The paper's table (two GPUs; ``--dry-run`` first to see the commands)::

    .venv/bin/lm-eval-safe leaderboard --preset paper --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lm_eval_safe.cli_options import (
    add_data_dir,
    add_members,
    add_tasks,
    optional_data_dir,
    repository_root,
    split_list,
)
from lm_eval_safe.leaderboard.configs import (
    DEFAULT_TASKS,
    ENSEMBLE_CONFIGS,
    PAPER_PAIRS,
    PAPER_PRESET,
    PaperPair,
    build_configs,
)
from lm_eval_safe.leaderboard.html_report import write_report
from lm_eval_safe.leaderboard.report import leaderboard_header, markdown_table, plot
from lm_eval_safe.leaderboard.runner import RunSettings, cell_run_dir, run_all
from lm_eval_safe.model_args import member_display_name


def runs_folder(name: str) -> Path:
    """Where results go without ``--out``: ``benchmarks/runs/<name>`` of the repository
    checkout, or of the current folder for an installed wheel."""
    root = repository_root()
    return (root if root is not None else Path()) / "benchmarks" / "runs" / name


#: the defaults of the options a preset may set: given explicitly they win over both
BASE_DEFAULTS: dict[str, Any] = {
    "tasks": ",".join(DEFAULT_TASKS),
    "configs": "all",
    "max_gen_toks": None,
    "model_args_extra": "",
    "alone_args": "",
    "ensemble_args": "",
    "apply_chat_template": False,
    "runner": "inprocess",
}
PRESETS: dict[str, dict[str, Any]] = {"paper": PAPER_PRESET}


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


def configure(parser: argparse.ArgumentParser) -> None:
    """The command line's options; those a ``--preset`` sets have no argparse default, so
    that :func:`finish_args` can tell an option given (which wins) from one left out."""
    _what_to_run(parser)
    _how_to_run(parser)


def build_parser() -> argparse.ArgumentParser:
    """The leaderboard's own parser, as ``lm-eval-safe leaderboard`` builds it."""
    parser = argparse.ArgumentParser(prog="lm-eval-safe leaderboard", description=DESCRIPTION)
    configure(parser)
    return parser


DESCRIPTION = (
    "Members alone vs. SAFE and baseline ensembles on lm-eval tasks; resumable (results cached "
    "per configuration+task+limit in --out)."
)


def _what_to_run(parser: argparse.ArgumentParser) -> None:
    """The options that choose the cells: members, tasks, limits, configurations, data."""
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="paper: the SAFE paper's Table 2 (its two model pairs by hub id, 2 GPUs); "
        "--members is then not used",
    )
    add_members(parser, default=None)
    add_tasks(parser, argparse.SUPPRESS, shown=BASE_DEFAULTS["tasks"])
    parser.add_argument(
        "--limit",
        default=None,
        help="samples per (sub)task: N for every task, or per task, e.g. "
        "safe_gsm8k=10,safe_math500=5,safe_bbh_paper=1 (tasks not named: all samples)",
    )
    parser.add_argument(
        "--configs",
        default=argparse.SUPPRESS,
        help="comma list: all (the default), alone, alone:<member> (or <member>), " + ", ".join(ENSEMBLE_CONFIGS),
    )
    parser.add_argument("--max-gen-toks", type=int, default=argparse.SUPPRESS, help="generation budget override")
    add_data_dir(parser, hub=True)


def _how_to_run(parser: argparse.ArgumentParser) -> None:
    """The options of where results go, the model arguments added, and how cells run."""
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: benchmarks/runs/leaderboard, benchmarks/runs/paper with "
        "--preset paper, in the repository checkout, else in the current folder)",
    )
    parser.add_argument(
        "--model-args-extra", default=argparse.SUPPRESS, help="appended to every model_args, e.g. device=cpu"
    )
    parser.add_argument(
        "--alone-args",
        default=argparse.SUPPRESS,
        help="appended to the model_args of members alone, e.g. device=cuda:0",
    )
    parser.add_argument(
        "--ensemble-args",
        default=argparse.SUPPRESS,
        help="appended to the model_args of ensembles, e.g. member_devices=cuda:0|cuda:1",
    )
    parser.add_argument(
        "--apply-chat-template",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help="render prompts with each member's own chat template (instruct models; default: off, "
        "on with --preset paper)",
    )
    parser.add_argument(
        "--runner",
        choices=("inprocess", "cli"),
        default=argparse.SUPPRESS,
        help="inprocess (the default): simple_evaluate in this process; cli: one lm_eval process "
        "per cell (fresh GPU memory per cell, --use_cache resumes a killed cell)",
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
        help="also keep each run's responses (<name>.samples.json, and lm_eval's results and "
        "samples_*.jsonl in <out>/lm_eval/<cell>/), ensembles with trace=true, and write "
        "the HTML report beside the markdown (lm-eval-safe report over those folders)",
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


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed options, normalised: what was left out taken from the preset (if any), else
    the defaults; comma lists split, limits per task, folders resolved."""
    preset = args.preset
    for key, value in {**BASE_DEFAULTS, **(PRESETS[preset] if preset else {})}.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    if preset is None and not args.members:
        raise SystemExit("--members: give at least one member (or --preset paper)")
    if preset is not None and args.members:
        raise SystemExit(f"--preset {preset} names its own members; drop --members")
    args.members = split_list(args.members)
    args.tasks = split_list(args.tasks)
    args.configs = split_list(args.configs)
    args.limits = parse_limits(args.limit, args.tasks)
    args.data_dir = optional_data_dir(args.data_dir)
    args.out = (args.out or runs_folder(preset or "leaderboard")).resolve()
    args.markdown = args.markdown or args.out / "leaderboard.md"
    args.plot = args.plot or args.out / "leaderboard.png"
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring for an example), normalised."""
    return finish_args(build_parser().parse_args(argv))


def run_settings(args: argparse.Namespace) -> RunSettings:
    """What the runner needs from the command line."""
    return RunSettings(
        tasks=args.tasks,
        limits=args.limits,
        out=args.out,
        max_gen_toks=args.max_gen_toks,
        model_args_extra=args.model_args_extra,
        alone_args=args.alone_args,
        ensemble_args=args.ensemble_args,
        apply_chat_template=args.apply_chat_template,
        data_dir=args.data_dir,
        runner=args.runner,
        dry_run=args.dry_run,
        report_only=args.report_only,
        save_samples=args.save_samples,
    )


def leaderboard(
    settings: RunSettings,
    members: list[str],
    config_names: list[str],
    markdown: Path,
    plot_path: Path,
    paper: PaperPair | None = None,
) -> str:
    """Run (or resume) one member set's leaderboard and write its table and plot; in a dry run
    print the commands instead and return the table of what is cached."""
    configs = build_configs(members, config_names)
    note = "# " if settings.dry_run else ""
    print(
        f"{note}compare: {len(configs)} configurations x {len(settings.tasks)} tasks, "
        f"limits={settings.limits}, out={settings.out}",
        flush=True,
    )
    outcomes = run_all(settings, configs)
    table = markdown_table(outcomes, configs, settings.tasks, paper)
    if settings.dry_run:
        return table
    header = leaderboard_header(
        members,
        settings.limits,
        settings.max_gen_toks,
        settings.apply_chat_template,
        settings.model_args_extra,
    )
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(header + table)
    plot(outcomes, configs, settings.tasks, plot_path)
    print(table, flush=True)
    print(f"wrote {markdown} and {plot_path}", flush=True)
    if settings.save_samples:
        folders = [cell_run_dir(c, t, settings) for t in settings.tasks for c in configs]
        found = [f for f in folders if f.is_dir() and any(f.rglob("results_*.json"))]
        if len(found) < len(folders):  # cells cached by a run without --save-samples
            print(f"report: {len(folders) - len(found)} cells have no lm-eval folder; rerun them with --save-samples to see them", flush=True)
        if found:
            report = write_report(found, markdown.with_suffix(".html"))
            print(f"wrote {report}", flush=True)
    return table


def print_dry_run_table(table: str) -> None:
    """A dry run's table as comments, so that its output stays a list of runnable commands."""
    print("".join(f"# {line}\n" for line in table.splitlines()), end="", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``lm-eval-safe leaderboard`` with a plain argument list (the tests, scripts/compare.py)."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run (or resume) the leaderboard(s), then write the markdown table(s) and the PNG(s)."""
    args = finish_args(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    settings = run_settings(args)
    if args.preset != "paper":
        table = leaderboard(settings, args.members, args.configs, args.markdown, args.plot)
        if args.dry_run:
            print_dry_run_table(table)
        return 0
    for pair in PAPER_PAIRS:
        # one --out for both pairs: Qwen2.5 alone is in both and runs (and is cached) once;
        # the shallow copy shares the set of printed commands, so it is also printed once
        drafter = member_display_name(pair.members[0])
        ensemble_args = ",".join(a for a in (f"drafter={drafter}", args.ensemble_args) if a)
        pair_settings = dataclasses.replace(settings, ensemble_args=ensemble_args)
        numbers = (
            "paper numbers: docs/algorithm.md, The paper's numbers" if pair.accuracy else "no paper numbers in docs/algorithm.md"
        )
        print(
            f"# {pair.name}: {' + '.join(pair.members)}, drafter {drafter}; {numbers}", flush=True
        )
        table = leaderboard(
            pair_settings,
            list(pair.members),
            args.configs,
            args.out / f"leaderboard_{pair.name}.md",
            args.out / f"leaderboard_{pair.name}.png",
            pair,
        )
        if args.dry_run:
            print_dry_run_table(table)
    return 0
