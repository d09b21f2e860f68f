"""Whole evaluation runs, side by side: lm-eval's ``hf`` on the drafter alone, ``safe-ensemble``
with the drafter alone, and the ensemble, through ``lm_eval.simple_evaluate`` in one process.
With ``--engine NAME`` (any engine of the registry) the members run on that engine, beside the
same ensemble on transformers (``ensemble_hf``), with ``--engine-args`` (the engine's own
model_args); where lm-eval has a backend of its own for the engine (``vllm``), it runs the
drafter alone beside them.

Each round also times the ensemble's *floor*: the least any draft-then-verify ensemble of these
members costs on the engine, measured, not modelled. It is the drafter's own run per generated
token (the fastest drafter-alone run whose responses equal safe-ensemble's alone: lm-eval's own
backend of the engine, or safe-ensemble's single-member path) times the tokens the ensemble
generated, plus each verifier alone reading the ensemble's texts: one ``loglikelihood`` request
per (context, response) the ensemble answered, on the same engine and batch size, which prefills
the verifier's prompt and reads its distribution at every generated position. The ensemble over
its floor is then what SAFE itself adds (its host work, drafts a verifier replaced, windows read
twice), apart from what a second model costs whatever the method.

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

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/lm-eval-safe bench eval \\
        --members smollm2-135m,gemma3-270m --drafter gemma3-270m --limit 6 --batch-size 8 --max-gen-toks 96

On vLLM (an environment from ``bash scripts/setup.sh --vllm``), batch ``auto``::

    .venv-vllm/bin/lm-eval-safe bench eval --engine vllm --limit 8 --batch-size auto \\
        --engine-args enforce_eager=true,kv_cache_memory_bytes=1073741824

On llama.cpp (``bash scripts/setup.sh --llama-cpp``)::

    .venv/bin/lm-eval-safe bench eval --engine llama_cpp --limit 8 --batch-size auto
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lm_eval_safe
from lm_eval_safe.bench import commands
from lm_eval_safe.bench.eval_report import markdown, scores
from lm_eval_safe.bench.eval_runs import (
    VERIFIER_READS,
    Rounds,
    floor,
    least_reads,
    read_answers,
    record_answers,
    reset_stores,
)
from lm_eval_safe.bench.output import write_json_report
from lm_eval_safe.cli_options import (
    DEFAULT_MEMBERS,
    add_data_dir,
    add_drafter,
    add_engine,
    add_members,
    add_tasks,
    local_data_dir,
    members_with_drafter_first,
    split_list,
)
from lm_eval_safe.engines.registry import DEFAULT_ENGINE

#: Every run a report may hold, in the order of the first round.
RUNS = ("hf", "vllm", "alone", "ensemble", "ensemble_hf")
#: the engine lm-eval has a backend of its own for (``--model vllm``), run on the drafter alone
LM_EVAL_OWN_BACKEND = "vllm"
LABELS = {
    "hf": "lm-eval hf, drafter alone",
    "vllm": "lm-eval vllm, drafter alone",
    "alone": "safe-ensemble, drafter alone",
    "ensemble": "safe-ensemble, ensemble",
    "ensemble_hf": "safe-ensemble, ensemble on transformers",
    VERIFIER_READS: "verifiers alone, reading the ensemble's texts",
}


def labels(report: dict[str, Any]) -> dict[str, str]:
    """Every run's name in the tables; safe-ensemble's runs on another engine say which."""
    engine = report["engine"]
    on = {"alone", "ensemble", VERIFIER_READS} if engine != DEFAULT_ENGINE else set()
    return {name: f"{LABELS[name]} on {engine}" if name in on else LABELS[name] for name in LABELS}


DEFAULT_TASKS = "safe_bbh_date_understanding,safe_bbh_logical_deduction_three_objects,safe_bbh_navigate"


#: the drafter with the default members (they list it second, in the README's order)
DEFAULT_DRAFTER = "gemma3-270m"


def configure(p: argparse.ArgumentParser) -> None:
    add_members(p)
    add_drafter(p, help_default=f"{DEFAULT_DRAFTER} with the default members, else the first member")
    add_tasks(p, DEFAULT_TASKS)
    p.add_argument("--limit", type=int, default=6, help="documents per task")
    p.add_argument("--batch-size", default="8", help="an integer or auto")
    add_engine(
        p,
        "model_args of every run on --engine (and of lm-eval's own backend of it), e.g. "
        "enforce_eager=true,kv_cache_memory_bytes=1073741824 for vLLM's CPU build",
        aliases=("--vllm-args", "--llama-cpp-args"),
    )
    p.add_argument("--max-gen-toks", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1, help="rounds; order reverses every round")
    p.add_argument(
        "--ensemble-args",
        default="",
        help="extra model_args of the ensemble run, e.g. aggregator=gac,draft_len=3",
    )
    p.add_argument("--alone-args", default="", help="extra model_args of both safe-ensemble runs")
    p.add_argument("--apply-chat-template", action="store_true")
    add_data_dir(p)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--skip",
        default="",
        help=f"comma list of runs to skip: hf, alone, ensemble, ensemble_hf, {VERIFIER_READS}, {LM_EVAL_OWN_BACKEND}",
    )
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--markdown", default=None, help="write a markdown table here")


def ordered_members(args: argparse.Namespace) -> list[str]:
    """The drafter, then the verifiers in the order --members gives them."""
    drafter = args.drafter if args.drafter is not None else DEFAULT_DRAFTER if args.members == DEFAULT_MEMBERS else "0"
    return members_with_drafter_first(split_list(args.members), drafter)


def model_args(members: list[str], extra: str, batch_size: int | str) -> str:
    args = f"members={'|'.join(members)},batch_size={batch_size}"
    return f"{args},{extra}" if extra else args


@dataclass
class Bench:
    """What every run of one benchmark shares: its arguments, tasks and loaded models."""

    args: argparse.Namespace
    tasks: list[str]
    verifiers: list[str]
    task_manager: Any
    batch: int | str
    engine: str  # --engine
    models: dict[str, Any] = field(default_factory=dict)
    #: each verifier alone on the engine, for the floor's reads
    verifier_models: dict[str, Any] = field(default_factory=dict)
    #: the (context, response) pairs of the ensemble's last run, in the order it answered them
    ensemble_answers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def vllm(self) -> bool:
        return self.engine == LM_EVAL_OWN_BACKEND  # lm-eval's own backend of --engine runs beside it

    @property
    def engine_args(self) -> str:
        """The model_args that put a safe-ensemble run on ``--engine``."""
        if self.engine == DEFAULT_ENGINE:
            return self.args.engine_args
        return ",".join(a for a in (f"engine={self.engine}", self.args.engine_args) if a)


def load_safe_models(bench: Bench, skip: set[str]) -> None:
    """The ``safe-ensemble`` runs: the drafter alone, the ensemble, and on another engine than
    transformers the same ensemble on transformers."""
    from lm_eval_safe.harness.model import SafeEnsembleLM

    args, batch = bench.args, bench.batch
    engine = bench.engine_args
    alone_args = ",".join(a for a in (args.alone_args, engine) if a)
    ensemble_args = ",".join(a for a in (args.alone_args, args.ensemble_args) if a)
    members = [args.drafter, *bench.verifiers]
    if "alone" not in skip:
        bench.models["alone"] = SafeEnsembleLM.create_from_arg_string(
            model_args([args.drafter], alone_args, batch)
        )
    if "ensemble" not in skip:
        bench.models["ensemble"] = SafeEnsembleLM.create_from_arg_string(
            model_args(members, ",".join(a for a in (ensemble_args, engine) if a), batch)
        )
    if bench.engine != DEFAULT_ENGINE and "ensemble_hf" not in skip:
        bench.models["ensemble_hf"] = SafeEnsembleLM.create_from_arg_string(
            model_args(members, ensemble_args, batch)
        )
    if {"ensemble", "alone"} <= bench.models.keys() and VERIFIER_READS not in skip:  # the floor needs both
        record_answers(bench.models["ensemble"], bench.ensemble_answers)
        for verifier in bench.verifiers:
            bench.verifier_models[verifier] = SafeEnsembleLM.create_from_arg_string(
                model_args([verifier], alone_args, batch)
            )


def load_lm_eval_models(bench: Bench, skip: set[str]) -> None:
    """lm-eval's own backends on the drafter alone: ``vllm`` (with ``--engine vllm``) on the
    settings safe-ensemble's vLLM drafter runs with, and ``hf`` on the very model object of a
    transformers drafter already loaded."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval_safe.engines.hf.batch import AUTO_CPU_ROWS
    from lm_eval_safe.harness.model import SafeEnsembleLM

    args, batch, models = bench.args, bench.batch, bench.models
    if bench.vllm and "vllm" not in skip:
        from lm_eval.models.vllm_causallms import VLLM

        from lm_eval_safe.model_args import parse_model_args

        on_vllm = models.get("alone") or models["ensemble"]
        settings = {**on_vllm.drafter.engine.settings, **parse_model_args(args.engine_args)}
        folder = settings.pop("model")
        settings = {k: v for k, v in settings.items() if k not in ("trust_remote_code", "max_logprobs")}
        models["vllm"] = VLLM(pretrained=folder, batch_size=batch, **settings)
    if "hf" not in skip:
        hf_drafter = next(
            (lm.drafter for lm in models.values() if isinstance(lm, SafeEnsembleLM) and lm.drafter.engine.kind == DEFAULT_ENGINE),
            None,
        )
        if hf_drafter is None:
            hf_drafter = SafeEnsembleLM.create_from_arg_string(model_args([args.drafter], "", batch)).drafter
        models["hf"] = HFLM(
            pretrained=hf_drafter.engine.model,
            tokenizer=hf_drafter.tokenizer,
            # lm-eval hf's own auto probes for out-of-memory errors, which a CPU never raises:
            # the rows safe-ensemble's auto takes on a CPU
            batch_size=AUTO_CPU_ROWS if batch == "auto" else batch,
            max_length=hf_drafter.max_length,
            device=str(hf_drafter.device),
        )


def evaluate(bench: Bench, name: str, limit: int, log: bool = True) -> tuple[dict[str, Any], float]:
    """One ``simple_evaluate`` of run ``name``, from empty prefix caches; with its wall time."""
    import lm_eval

    from lm_eval_safe.harness.model import SafeEnsembleLM

    lm, args = bench.models[name], bench.args
    if isinstance(lm, SafeEnsembleLM):
        reset_stores(lm)
    elif name == "vllm":
        lm.model.reset_prefix_cache()
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=bench.tasks,
        limit=limit,
        task_manager=bench.task_manager,
        gen_kwargs={"max_gen_toks": args.max_gen_toks},
        apply_chat_template=args.apply_chat_template,
        log_samples=log,
        bootstrap_iters=0,
    )
    return results, time.perf_counter() - start


def timed_rounds(bench: Bench) -> Rounds:
    """``--repeats`` rounds over every run, the order reversed every other round."""
    from lm_eval_safe.harness.model import SafeEnsembleLM

    order = [name for name in RUNS if name in bench.models]
    rounds = Rounds({name: [] for name in order})
    if bench.verifier_models:
        rounds.runs[VERIFIER_READS] = []
    for round_ in range(bench.args.repeats):
        for name in order if round_ % 2 == 0 else order[::-1]:
            results, wall = evaluate(bench, name, bench.args.limit)
            rounds.runs[name].append(wall)
            rounds.outputs[name] = results
            lm = bench.models[name]
            if isinstance(lm, SafeEnsembleLM):
                rounds.stats[name] = lm.run_stats.summary()
            print(f"round {round_ + 1} {name}: {wall:.1f} s", flush=True)
            if name == "ensemble" and bench.verifier_models:
                rounds.reads = read_answers(bench.verifier_models.values(), bench.ensemble_answers)
                rounds.runs[VERIFIER_READS].append(least_reads(rounds.reads))
                print(f"round {round_ + 1} {VERIFIER_READS}: {rounds.reads}", flush=True)
    return rounds


def build_report(bench: Bench, rounds: Rounds, loaded: float, warm: float) -> dict[str, Any]:
    import torch

    args, ratio, same = bench.args, rounds.ratio, rounds.same
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "tasks": bench.tasks,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "max_gen_toks": args.max_gen_toks,
        "members": [args.drafter, *bench.verifiers],
        "ensemble_args": args.ensemble_args,
        "load_seconds": round(loaded, 1),
        "warmup_seconds": round(warm, 1),
        "wall_seconds": rounds.runs,
        "engine": args.engine,
        "ensemble_over_hf": ratio("ensemble", "hf"),
        "alone_over_hf": ratio("alone", "hf"),
        "ensemble_over_alone": ratio("ensemble", "alone"),
        "alone_responses_equal_hf": same("alone", "hf"),
        **(
            {
                f"ensemble_{bench.engine}_over_ensemble_hf": ratio("ensemble", "ensemble_hf"),
                f"alone_{bench.engine}_over_hf": ratio("alone", "hf"),
                "ensemble_responses_equal_ensemble_hf": same("ensemble", "ensemble_hf"),
            }
            if bench.engine != DEFAULT_ENGINE
            else {}
        ),
        **(
            {
                "ensemble_over_lm_eval_vllm": ratio("ensemble", "vllm"),
                "alone_over_lm_eval_vllm": ratio("alone", "vllm"),
                "alone_responses_equal_lm_eval_vllm": same("alone", "vllm"),
            }
            if bench.vllm
            else {}
        ),
        "floor": floor(rounds, LM_EVAL_OWN_BACKEND if bench.vllm else "hf"),
        "scores": {name: scores(res) for name, res in rounds.outputs.items()},
        "safe_stats": rounds.stats,
    }


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench eval`` with a plain argument list."""
    return commands.main("eval", argv)


def run(args: argparse.Namespace) -> int:
    members = ordered_members(args)
    args.drafter = members[0]
    args.data_dir = str(local_data_dir(args.data_dir, "lm-eval-safe bench eval"))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # what the steps import, imported before the load clock starts
    import lm_eval  # noqa: F401
    from lm_eval.models.huggingface import HFLM  # noqa: F401
    from lm_eval.tasks import TaskManager

    from lm_eval_safe.harness.model import SafeEnsembleLM  # noqa: F401

    task_manager = TaskManager(
        include_path=lm_eval_safe.task_dir(), metadata={"data_dir": args.data_dir}
    )
    bench = Bench(
        args,
        tasks=split_list(args.tasks),
        verifiers=members[1:],
        task_manager=task_manager,
        batch=args.batch_size if args.batch_size == "auto" else int(args.batch_size),
        engine=args.engine,
    )
    skip = {s for s in args.skip.split(",") if s}
    started = time.perf_counter()
    load_safe_models(bench, skip)
    load_lm_eval_models(bench, skip)
    loaded = time.perf_counter() - started

    # one-time costs (token vocabularies, small-row timings, union vocabulary, the first
    # forward of each model, dataset loading) before timing
    warm_start = time.perf_counter()
    for name in bench.models:
        evaluate(bench, name, 1, log=False)
    if bench.verifier_models:
        read_answers(bench.verifier_models.values(), bench.ensemble_answers)
    warm = time.perf_counter() - warm_start

    report = build_report(bench, timed_rounds(bench), loaded, warm)
    print(json.dumps(report, indent=2))
    if args.json:
        write_json_report(Path(args.json), report, trailing_newline=True)
    if args.markdown:
        base = "vllm" if report["wall_seconds"].get("vllm") else "hf"
        Path(args.markdown).write_text(markdown(report, labels(report), base))
    return 0

