#!/usr/bin/env python3
"""Whole evaluation runs, side by side: lm-eval's ``hf`` on the drafter alone, ``safe-ensemble``
with the drafter alone, and the ensemble, through ``lm_eval.simple_evaluate`` in one process.

Why this benchmark: a user judges the backend by what a whole ``lm_eval`` run costs next to
lm-eval's own ``hf`` backend on one model, with real task prompts (few-shot exemplars, chat
templates), not by the per-token speed of bare prompts. Every configuration runs the same
tasks, ``limit``, batch size and ``gen_kwargs``; the ``hf`` run wraps the very model object the
single-member run uses, so weights and dtype are identical. Runs are interleaved over
``--repeats`` rounds (hf, alone, ensemble, then the reverse order) so drift of the machine hits
all alike; each run starts with empty prefix stores, so a later run never inherits an earlier
run's cached prompts. One-time costs (building token vocabularies, timing the small-row
linears, union vocabularies) are paid in a warm-up before timing and reported separately.

It prints wall times, the ratios, and whether the single-member responses equal ``hf``'s.

Example (BBH, 3 subtasks x 6 questions sharing 3-shot exemplars, batch 8)::

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python scripts/bench_eval.py \\
        --drafter gemma3-270m --verifiers smollm2-135m --limit 6 --batch-size 8 --max-gen-toks 96
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lm_eval_safe.bench.output import fmt, write_json_report  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TASKS = (
    "safe_bbh_date_understanding,safe_bbh_logical_deduction_three_objects,safe_bbh_navigate"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--drafter", default="gemma3-270m")
    p.add_argument("--verifiers", default="smollm2-135m", help="comma list")
    p.add_argument("--tasks", default=DEFAULT_TASKS, help="comma list of task names")
    p.add_argument("--limit", type=int, default=6, help="documents per task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-gen-toks", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1, help="rounds; order reverses every round")
    p.add_argument(
        "--ensemble-args",
        default="",
        help="extra model_args of the ensemble run, e.g. aggregator=gac,draft_len=3",
    )
    p.add_argument("--alone-args", default="", help="extra model_args of both safe-ensemble runs")
    p.add_argument("--apply-chat-template", action="store_true")
    p.add_argument("--data-dir", default=str(REPO_ROOT.parent / "shared" / "data"))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--skip", default="", help="comma list of runs to skip: hf, alone, ensemble")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--markdown", default=None, help="write a markdown table here")
    return p.parse_args(argv)


def model_args(members: list[str], extra: str, batch_size: int) -> str:
    args = f"members={'|'.join(members)},batch_size={batch_size}"
    return f"{args},{extra}" if extra else args


def responses(results: dict[str, Any]) -> dict[tuple[str, int], str]:
    out = {}
    for task, samples in results.get("samples", {}).items():
        for sample in samples:
            out[task, int(sample["doc_id"])] = sample["resps"][0][0]
    return out


def scores(results: dict[str, Any]) -> dict[str, float]:
    return {
        task: value
        for task, metrics in results["results"].items()
        for key, value in metrics.items()
        if key.startswith("exact_match") and "stderr" not in key and isinstance(value, float)
    }


def reset_stores(lm: Any) -> None:
    from lm_eval_safe.engines.hf.prefix_cache import PrefixStore

    for member in lm.members:
        if member.engine.prefix_store is not None:
            member.engine.prefix_store = PrefixStore(member.engine.prefix_store.budget)
    lm._prefill_counted = [(0, 0) for _ in lm.members]
    from lm_eval_safe.stats import GenerationStats

    lm.run_stats = GenerationStats()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from lm_eval_safe.model import SafeEnsembleLM

    tasks = [t for t in args.tasks.split(",") if t]
    verifiers = [v for v in args.verifiers.split(",") if v]
    skip = {s for s in args.skip.split(",") if s}
    task_manager = TaskManager(
        include_path=str(REPO_ROOT / "tasks"), metadata={"data_dir": args.data_dir}
    )

    started = time.perf_counter()
    alone = SafeEnsembleLM.create_from_arg_string(
        model_args([args.drafter], args.alone_args, args.batch_size)
    )
    ensemble = SafeEnsembleLM.create_from_arg_string(
        model_args(
            [args.drafter, *verifiers],
            ",".join(a for a in (args.alone_args, args.ensemble_args) if a),
            args.batch_size,
        )
    )
    drafter = alone.members[0]
    hf = HFLM(
        pretrained=drafter.engine.model,
        tokenizer=drafter.tokenizer,
        batch_size=args.batch_size,
        max_length=drafter.max_length,
        device=str(drafter.device),
    )
    loaded = time.perf_counter() - started

    def evaluate(lm: Any, limit: int, log: bool = True) -> tuple[dict[str, Any], float]:
        if isinstance(lm, SafeEnsembleLM):
            reset_stores(lm)
        start = time.perf_counter()
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            limit=limit,
            task_manager=task_manager,
            gen_kwargs={"max_gen_toks": args.max_gen_toks},
            apply_chat_template=args.apply_chat_template,
            log_samples=log,
            bootstrap_iters=0,
        )
        return results, time.perf_counter() - start

    # one-time costs (token vocabularies, small-row timings, union vocabulary, the first
    # forward of each model, dataset loading) before timing
    warm_start = time.perf_counter()
    for name, lm in (("hf", hf), ("alone", alone), ("ensemble", ensemble)):
        if name not in skip:
            evaluate(lm, 1, log=False)
    warm = time.perf_counter() - warm_start

    runs: dict[str, list[float]] = {"hf": [], "alone": [], "ensemble": []}
    outputs: dict[str, dict[str, Any]] = {}
    stats: dict[str, dict[str, Any]] = {}
    order = [name for name in ("hf", "alone", "ensemble") if name not in skip]
    for round_ in range(args.repeats):
        for name in order if round_ % 2 == 0 else order[::-1]:
            lm = {"hf": hf, "alone": alone, "ensemble": ensemble}[name]
            results, wall = evaluate(lm, args.limit)
            runs[name].append(wall)
            outputs[name] = results
            if isinstance(lm, SafeEnsembleLM):
                stats[name] = lm.run_stats.summary()
            print(f"round {round_ + 1} {name}: {wall:.1f} s", flush=True)

    def median(name: str) -> float | None:
        return statistics.median(runs[name]) if runs[name] else None

    def ratio(a: str, b: str) -> float | None:
        x, y = median(a), median(b)
        return x / y if x is not None and y else None

    same = None
    if "hf" in outputs and "alone" in outputs:
        mine, theirs = responses(outputs["alone"]), responses(outputs["hf"])
        same = (sum(mine[k] == theirs.get(k) for k in mine), len(mine))
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "tasks": tasks,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "max_gen_toks": args.max_gen_toks,
        "members": [args.drafter, *verifiers],
        "ensemble_args": args.ensemble_args,
        "load_seconds": round(loaded, 1),
        "warmup_seconds": round(warm, 1),
        "wall_seconds": runs,
        "ensemble_over_hf": ratio("ensemble", "hf"),
        "alone_over_hf": ratio("alone", "hf"),
        "ensemble_over_alone": ratio("ensemble", "alone"),
        "alone_responses_equal_hf": same,
        "scores": {name: scores(res) for name, res in outputs.items()},
        "safe_stats": stats,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        write_json_report(Path(args.json), report, trailing_newline=True)
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    return 0


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"`{report['command']}`",
        "",
        f"{report['machine']}; tasks {', '.join(report['tasks'])}, {report['limit']} documents each, "
        f"batch {report['batch_size']}, max_gen_toks {report['max_gen_toks']}; members {', '.join(report['members'])} "
        f"({report['ensemble_args'] or 'defaults'})",
        "",
        "| run | wall s (median) | vs hf | vs safe-ensemble alone |",
        "|---|---:|---:|---:|",
    ]
    walls = report["wall_seconds"]
    for name, label in (
        ("hf", "lm-eval hf, drafter alone"),
        ("alone", "safe-ensemble, drafter alone"),
        ("ensemble", "safe-ensemble, ensemble"),
    ):
        if not walls[name]:
            continue
        med = statistics.median(walls[name])
        hf = statistics.median(walls["hf"]) if walls["hf"] else None
        al = statistics.median(walls["alone"]) if walls["alone"] else None
        lines.append(
            f"| {label} | {med:.1f} | {fmt(med / hf if hf else None)} | {fmt(med / al if al else None)} |"
        )
    same = report["alone_responses_equal_hf"]
    if same:
        lines += ["", f"safe-ensemble alone responses equal to hf's: {same[0]}/{same[1]}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
