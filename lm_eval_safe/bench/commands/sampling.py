"""Sampled SAFE against greedy SAFE on the same prompts: E/T, acceptance, how often
the speculative test keeps the drafted string, and tokens/s.

Why it measures what it does
----------------------------
* Same members, same prompts (GSM8K questions in each member's chat template, as
  ``--apply_chat_template`` gives them), same schedule and aggregator; only the decoding
  changes: greedy, or ``do_sample=True`` at ``--temperature`` (``--top-k``/``--top-p``).
* Sampling ensembles at every aligned position (SAFE's consensus skip holds for an argmax only,
  README "Sampling"), so its E/T is expected to be higher than greedy's and its speed lower;
  this script says by how much. ``keep`` is the share of ensemble points whose drafted string
  survived the test (greedy: the ensemble's argmax was the drafter's own token).
* Greedy and sampled runs alternate prompt by prompt, so drift of a shared machine hits both
  alike; tokens/s on a loaded machine are indicative only. ``--ignore-eos`` masks EOS so every
  run generates exactly ``--max-new-tokens`` (speed only: the texts are not answers).

Example::

    .venv/bin/lm-eval-safe bench sampling --prompts 4 --max-new-tokens 64 --ignore-eos
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

from lm_eval_safe.bench import commands
from lm_eval_safe.bench.eos import mask_eos
from lm_eval_safe.bench.output import write_json_report
from lm_eval_safe.bench.prompts import load_prompts
from lm_eval_safe.bench.speed import make_decoder
from lm_eval_safe.bench.timing import timed
from lm_eval_safe.cli_options import add_data_dir, add_members, local_data_dir
from lm_eval_safe.decoder.stats import GenerationStats
from lm_eval_safe.ensemble.sampling import GenerationSettings, SamplingParams, request_seed
from lm_eval_safe.harness.model import SafeEnsembleLM


def configure(parser: argparse.ArgumentParser) -> None:
    add_members(parser)
    parser.add_argument("--aggregators", default="gac,unite")
    parser.add_argument("--schedule", default="safe")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--ignore-eos", action="store_true")
    add_data_dir(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")


def summary(stats: GenerationStats) -> dict[str, float]:
    return {
        "tokens": stats.generated_tokens,
        "ensembles": stats.ensemble_ops,
        "E/T %": round(stats.ensemble_rate, 2),
        "acceptance": round(stats.acceptance_rate, 3),
        "keep": round(stats.ensemble_keep_rate, 3),
        "tok/s": round(stats.tokens_per_second, 2),
        "verifier positions/token": round(
            stats.verifier_positions / max(1, stats.generated_tokens), 2
        ),
    }


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench sampling`` with a plain argument list."""
    return commands.main("sampling", argv)


def run(args: argparse.Namespace) -> int:
    args.data_dir = local_data_dir(args.data_dir, "lm-eval-safe bench sampling")
    lm = SafeEnsembleLM(members=args.members, device=args.device, dtype=args.dtype)
    members = lm.members
    if args.ignore_eos:
        mask_eos(members)
    prompts = load_prompts(args.data_dir, "gsm8k", args.prompts)
    contexts = [lm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    sampled = SamplingParams(True, args.temperature, args.top_k, args.top_p)
    settings = GenerationSettings([], args.max_new_tokens, sampled)
    # the model_args the model was built with (its options as a dict also hold every engine's
    # defaults, which parse_options refuses for engines no member runs on)
    base = {"members": args.members, "device": args.device, "dtype": args.dtype, "schedule": args.schedule}
    results: dict[str, Any] = {
        "config": vars(args) | {"data_dir": str(args.data_dir), "output": None}
    }
    for aggregator in args.aggregators.split(","):
        decoder = make_decoder(members, lm.drafter_index, base, {"aggregator": aggregator})
        decoder.generate(contexts[0], [], 4)  # warm-up: union vocabulary, lazy tables
        totals = {"greedy": GenerationStats(), "sampled": GenerationStats()}
        for context in contexts:
            for mode, total in totals.items():
                params = sampled if mode == "sampled" else None
                seed = request_seed(args.seed, context, settings, 0)
                generate = partial(
                    decoder.generate, context, [], args.max_new_tokens, params, seed
                )
                (_, stats), seconds = timed(generate, members)
                stats.wall_seconds = seconds
                total.add(stats)
        for mode, total in totals.items():
            row = summary(total)
            results[f"{args.schedule}-{aggregator}/{mode}"] = row
            print(
                f"{args.schedule}-{aggregator:5s} {mode:7s} "
                + "  ".join(f"{k}={v}" for k, v in row.items()),
                flush=True,
            )
    if args.output:
        write_json_report(args.output, results, indent=1)
    return 0

