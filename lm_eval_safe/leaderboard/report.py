"""What a leaderboard shows: the numbers of every cell, its markdown tables and its plot.

The figures of a cell (:func:`cell_figures`) are computed here once, from outcomes, and every
view formats them: the markdown table of ``lm-eval-safe leaderboard`` and any other report over the
same results, so two views of one run can never disagree. Accuracy prints with the gap to the
best single member as the paper does (``76.0 (+1.2)``), plus a 95% Wilson interval from the
sample count: on small subsets the interval is what tells whether a gap means anything.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_safe.leaderboard.configs import PAPER_LABELS, Config, PaperPair
from lm_eval_safe.leaderboard.result_cache import Outcome

DETAIL_HEADER = (
    "| configuration | accuracy % (gap) | 95% CI (Wilson) | n | E/T % | acceptance | tokens "
    "| tok/s | wall s |"
)


def wilson_interval(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: sane at n of a few and at p = 0 or 1."""
    if n <= 0:
        return 0.0, 1.0
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value of two configurations answering the same questions:
    ``only_first`` questions the first got right and the second wrong, ``only_second`` the
    reverse. Under "neither is better" each such discordant question goes either way with
    probability 1/2, so the smaller count is binomial(n, 1/2) with n both counts together;
    the questions both got right or both wrong say nothing about the difference. Wilson
    intervals of each configuration apart cannot show this: the pairing is what removes the
    questions' own difficulty from the comparison."""
    n = only_first + only_second
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_first, only_second) + 1)) / 2**n
    return min(1.0, 2 * tail)


def best_single(outcomes: Sequence[Outcome], configs: Sequence[Config], task: str) -> float | None:
    """Accuracy of the best member alone on ``task`` (None when no member-alone row ran)."""
    singles = {c.name for c in configs if c.is_single}
    values = [
        o.accuracy
        for o in outcomes
        if o.task == task and o.config in singles and o.accuracy is not None
    ]
    return max(values) if values else None


@dataclass(frozen=True)
class CellFigures:
    """The numbers of one (configuration, task) cell, in the units a reader sees."""

    accuracy_percent: float | None
    gap_points: float | None  # to the best member alone; ensembles only
    interval_percent: tuple[float, float] | None  # 95% Wilson interval
    n: int
    et_percent: float | None
    acceptance: float | None
    generated_tokens: int | None
    tokens_per_second: float | None
    wall_seconds: float


def cell_figures(outcome: Outcome, best: float | None, is_single: bool) -> CellFigures:
    """One cell's figures; ``best`` is :func:`best_single` of its task."""
    accuracy = outcome.accuracy
    gap = None
    if accuracy is not None and best is not None and not is_single:
        gap = 100 * (accuracy - best)
    interval = None
    if accuracy is not None and outcome.n:
        lo, hi = wilson_interval(accuracy, outcome.n)
        interval = (100 * lo, 100 * hi)
    return CellFigures(
        accuracy_percent=None if accuracy is None else 100 * accuracy,
        gap_points=gap,
        interval_percent=interval,
        n=outcome.n,
        et_percent=outcome.et_percent,
        acceptance=outcome.acceptance,
        generated_tokens=outcome.generated_tokens,
        tokens_per_second=outcome.tokens_per_second,
        wall_seconds=outcome.wall_seconds,
    )


def paper_numbers(paper: PaperPair | None, config: str, task: str) -> tuple[Any, Any]:
    """(accuracy, E/T) the paper reports for a cell; None where it reports none."""
    if paper is None:
        return None, None
    et = paper.et_math500.get(config) if task == "safe_math500" else None
    return paper.accuracy.get((config, task)), et


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------


def fmt(value: float | None, pattern: str) -> str:
    """Format or dash."""
    return "-" if value is None else pattern.format(value)


def accuracy_cell(
    outcome: Outcome | None, best: float | None, is_single: bool, paper: float | None = None
) -> str:
    """``76.0 (+1.2)``: accuracy in %, gap in points to the best member (ensembles only); with
    the paper's number for the cell, ``76.0 (+1.2) [paper 77.4]``."""
    figures = None if outcome is None else cell_figures(outcome, best, is_single)
    if figures is None or figures.accuracy_percent is None:
        text = "-"
    else:
        text = f"{figures.accuracy_percent:.1f}"
        if figures.gap_points is not None:
            text += f" ({figures.gap_points:+.1f})"
    return text if paper is None else f"{text} [paper {paper}]"


def row_label(config: Config, paper: PaperPair | None) -> str:
    """A configuration's row name; in a paper table with the paper's method name beside it."""
    label = PAPER_LABELS.get(config.name) if paper is not None else None
    return f"{config.name} ({label})" if label else config.name


def _overview(
    by_key: Mapping[tuple[str, str], Outcome],
    outcomes: Sequence[Outcome],
    configs: Sequence[Config],
    tasks: Sequence[str],
    paper: PaperPair | None,
) -> list[str]:
    """The configuration x task accuracy table, in the paper's layout."""
    metrics = ", ".join(
        f"{t}: {next((o.metric for o in outcomes if o.task == t and o.metric), '-')}"
        for t in tasks
    )
    lines = [
        f"Accuracy in % (gap to the best member alone, in points). Metric: {metrics}.",
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
                paper_numbers(paper, config.name, t)[0],
            )
            for t in tasks
        ]
        lines.append(f"| {row_label(config, paper)} | " + " | ".join(cells) + " |")
    return lines


def _detail_row(
    config: Config, outcome: Outcome | None, best: float | None, task: str, paper: PaperPair | None
) -> str:
    """One row of a task's detail table: every figure of the cell."""
    paper_acc, paper_et = paper_numbers(paper, config.name, task)
    label = row_label(config, paper)
    if outcome is None:
        cell = "not run" + ("" if paper_acc is None else f" [paper {paper_acc}]")
        et = "-" if paper_et is None else f"- [paper {paper_et}]"
        return f"| {label} | {cell} | - | - | {et} | - | - | - | - |"
    figures = cell_figures(outcome, best, config.is_single)
    if figures.interval_percent is None:
        ci = "-"
    else:
        lo, hi = figures.interval_percent
        ci = f"[{lo:.1f}, {hi:.1f}]"
    et = fmt(figures.et_percent, "{:.2f}") + ("" if paper_et is None else f" [paper {paper_et}]")
    return (
        f"| {label} | {accuracy_cell(outcome, best, config.is_single, paper_acc)} "
        f"| {ci} | {figures.n} | {et} | {fmt(figures.acceptance, '{:.3f}')} | "
        f"{fmt(figures.generated_tokens, '{:d}')} | {fmt(figures.tokens_per_second, '{:.2f}')} | "
        f"{figures.wall_seconds:.0f} |"
    )


def markdown_table(
    outcomes: Sequence[Outcome],
    configs: Sequence[Config],
    tasks: Sequence[str],
    paper: PaperPair | None = None,
) -> str:
    """Overview (config x task accuracy, paper layout) and one detail table per task; with
    ``paper``, the paper's accuracy (and MATH-500 E/T) beside each cell it reports."""
    by_key = {(o.config, o.task): o for o in outcomes}
    lines = _overview(by_key, outcomes, configs, tasks, paper)
    for task in tasks:
        best = best_single(outcomes, configs, task)
        lines += ["", f"### {task}", "", DETAIL_HEADER, "|---|---|---|---|---|---|---|---|---|"]
        lines += [
            _detail_row(config, by_key.get((config.name, task)), best, task, paper)
            for config in configs
        ]
    return "\n".join(lines) + "\n"


def leaderboard_header(
    members: Sequence[str],
    limits: Mapping[str, float | int | None],
    max_gen_toks: int | None,
    apply_chat_template: bool,
    model_args_extra: str,
) -> str:
    """The lines above a leaderboard's tables: what was run, with which settings."""
    return (
        f"# Leaderboard\n\nmembers: {', '.join(members)}; limit per (sub)task: {dict(limits)}; "
        f"max_gen_toks: {max_gen_toks}; chat template: {apply_chat_template}; "
        f"extra model_args: {model_args_extra or '-'}\n\n"
    )


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
# Plot
# --------------------------------------------------------------------------------------


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
