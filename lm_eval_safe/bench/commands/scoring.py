"""Scoring throughput: the ``safe-ensemble`` loglikelihood against lm-eval's ``hf`` model run
once per member, on the same multiple-choice requests with the same batch size.

Why it measures what it does
----------------------------
The goal is that ensemble scoring costs no more than scoring the members one after
another, i.e. ``sum of the members' hf times / ensemble time`` (the *throughput ratio*) stays
at or above 0.7. The machine is shared and noisy, so:

* every model is loaded once, then the three runs (ensemble, hf member 1, hf member 2) are
  interleaved within each repeat, so drift hits them alike; the ratio is reported per repeat
  and over the totals;
* one warm-up request per runner happens before timing (first-call allocations);
* requests are BBH ``date_understanding`` questions with their first four options as the
  continuations (one shared context per question, as in a multiple-choice task), optionally
  after the task's 3-shot prompt (``--shots 3``: long contexts, as lm-eval's BBH few-shot);
* the accuracy of each runner (the option with the highest log-likelihood is the target) is
  printed as a sanity check, not as a result: 20 questions say nothing about quality.

Example::

    HF_HUB_OFFLINE=1 .venv/bin/lm-eval-safe bench scoring --questions 20 --batch-size 1
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from lm_eval_safe.bench import commands
from lm_eval_safe.cli_options import add_data_dir, add_members, local_data_dir


def build_requests(data: Path, questions: int, shots: int) -> tuple[list[Any], list[int]]:
    """Instances (context, continuation) and, per question, the index of the right option."""
    from lm_eval.api.instance import Instance

    examples = json.loads((data / "bbh" / "tasks" / "date_understanding.json").read_text())[
        "examples"
    ]
    prefix = ""
    if shots:
        prompt = (data / "bbh" / "cot-prompts" / "date_understanding.txt").read_text()
        prefix = prompt.split("-----", 1)[-1].strip() + "\n\n"
    requests, targets = [], []
    for example in examples[:questions]:
        options = re.findall(r"^\(([A-F])\) (.*)$", example["input"], flags=re.M)[:4]
        context = f"{prefix}Q: {example['input']}\nA: The answer is"
        letters = [letter for letter, _ in options]
        target = example["target"].strip("()")
        targets.append(letters.index(target) if target in letters else -1)
        for letter, text in options:
            requests.append(
                Instance(
                    request_type="loglikelihood",
                    doc={},
                    arguments=(context, f" ({letter}) {text}"),
                    idx=0,
                )
            )
    return requests, targets


def accuracy(scores: list[tuple[float, bool]], targets: list[int]) -> float:
    hits = 0
    for q, target in enumerate(targets):
        values = [s for s, _ in scores[4 * q : 4 * q + 4]]
        hits += int(values.index(max(values)) == target)
    return hits / max(1, len(targets))


def configure(parser: argparse.ArgumentParser) -> None:
    add_members(parser)
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--shots", type=int, default=0, choices=(0, 3))
    parser.add_argument("--batch-size", default="1")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine two spinning OpenMP threads "
        "run an order of magnitude slower than one)",
    )
    add_data_dir(parser, aliases=("--data",))


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench scoring`` with a plain argument list."""
    return commands.main("scoring", argv)


def run(args: argparse.Namespace) -> int:
    data_dir = local_data_dir(args.data_dir, "lm-eval-safe bench scoring")

    import torch
    from lm_eval.models.huggingface import HFLM

    from lm_eval_safe.harness.model import SafeEnsembleLM

    torch.set_num_threads(args.threads)
    batch_size: int | str = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    requests, targets = build_requests(data_dir, args.questions, args.shots)
    ensemble = SafeEnsembleLM(members=args.members, device="cpu", batch_size=batch_size)
    hf = {
        m.name: HFLM(
            pretrained=str(Path(m.engine.model.name_or_path)),
            device="cpu",
            dtype="float32",
            batch_size=batch_size,
        )
        for m in ensemble.members
    }
    runners = {"ensemble": ensemble, **{f"hf:{name}": lm for name, lm in hf.items()}}
    print(
        f"{len(requests)} requests ({args.questions} questions x 4 options, {args.shots}-shot), "
        f"batch_size={batch_size}, torch threads={torch.get_num_threads()}"
    )
    for runner in runners.values():  # warm-up
        runner.loglikelihood(requests[:1], disable_tqdm=True)
    totals = dict.fromkeys(runners, 0.0)
    last: dict[str, list[tuple[float, bool]]] = {}
    for repeat in range(args.repeats):
        times = {}
        for name, runner in runners.items():
            start = time.perf_counter()
            last[name] = runner.loglikelihood(requests, disable_tqdm=True)
            times[name] = time.perf_counter() - start
            totals[name] += times[name]
        hf_sum = sum(t for n, t in times.items() if n != "ensemble")
        print(
            f"repeat {repeat}: ensemble {times['ensemble']:.2f}s, "
            + ", ".join(f"{n} {t:.2f}s" for n, t in times.items() if n != "ensemble")
            + f", hf sum {hf_sum:.2f}s, ratio (hf sum / ensemble) {hf_sum / times['ensemble']:.2f}"
        )
    hf_total = sum(t for n, t in totals.items() if n != "ensemble")
    print(
        f"total: ensemble {totals['ensemble']:.2f}s, hf sum {hf_total:.2f}s, "
        f"throughput ratio {hf_total / totals['ensemble']:.2f} (target >= 0.7)"
    )
    print("accuracy: " + ", ".join(f"{n} {accuracy(s, targets):.2f}" for n, s in last.items()))
    return 0
