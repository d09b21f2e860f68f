"""Throughput of batched SAFE generation: ``batch_size=N`` against ``batch_size=1``,
and two data-parallel processes against one.

Why it measures what it does
----------------------------
* Same members, same prompts (GSM8K questions in each member's chat template, as
  ``--apply_chat_template`` gives them), same greedy settings; only the batch size changes.
  Throughput is generated tokens per second of wall time over the whole set, the number that
  decides how long an evaluation takes. Batch sizes run back to back in one process, so the
  ratio compares like with like on a shared machine.
* Batched texts must equal ``batch_size=1``'s: the script counts identical answers and, for
  any that differ, prints where they first diverge (evidence for a float32 kernel difference,
  which must then be rare).
* The ensemble's gain (batch ``N`` over batch 1) is printed beside transformers ``generate``'s
  own gain on each member alone, on the same prompts in the same run (``--no-generate`` skips
  it): batching is healthy when the ensemble keeps the members' gain, whatever the machine.
  Beside it, each member's engine seconds inside the ensemble and the rest (the package's own
  work between the engine calls) at each batch size, and each part's gain: which part keeps
  the ensemble's gain short of the members'.
* ``--dp``: the same prompts at ``--dp-batch-size`` in one process with all threads, then
  through ``torchrun --nproc_per_node 2`` with half the threads each (documents split by
  rank, as lm-eval shards them). Wall time is the slowest rank's decoding time.

Example::

    .venv/bin/lm-eval-safe bench batch --prompts 32 --max-new-tokens 64 --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lm_eval_safe.bench import commands
from lm_eval_safe.bench.output import write_json_report
from lm_eval_safe.bench.prompts import load_prompts
from lm_eval_safe.bench.timing import timed
from lm_eval_safe.cli_options import add_data_dir, add_members, local_data_dir, split_list
from lm_eval_safe.engines import instruments
from lm_eval_safe.harness.model import SafeEnsembleLM, engine_clocks


def make_jobs(
    lm: SafeEnsembleLM, prompts: list[str], max_new: int
) -> list[tuple[str, list[str], int]]:
    contexts = [lm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return [(c, [], max_new) for c in contexts]


def timed_run(lm: SafeEnsembleLM, jobs: list[Any], batch_size: int) -> dict[str, Any]:
    before = engine_clocks(lm.members)
    results, seconds = timed(lambda: lm.decoder.generate_many(jobs, batch_size), lm.members)
    engine = {m.name: m.engine.counters.seconds - s for m, (_, s) in zip(lm.members, before, strict=True)}
    tokens = sum(stats.generated_tokens for _, stats in results)
    ensembles = sum(stats.ensemble_ops for _, stats in results)
    return {
        "batch_size": batch_size,
        "seconds": seconds,
        # where the run's time went: each member's engine calls, and the rest (this package's
        # work between them), so that a gain short of the members' says which part fell short
        "engine_seconds_by_member": engine,
        "host_seconds": seconds - sum(engine.values()),
        "tokens": tokens,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "ensemble_rate_percent": 100.0 * ensembles / tokens if tokens else 0.0,
        "texts": [text for text, _ in results],
    }


def time_parts(run: dict[str, Any]) -> dict[str, float]:
    """A timed run's seconds by part: each member's engine calls, then ``host``, the rest."""
    return {**run["engine_seconds_by_member"], "host": run["host_seconds"]}


def member_generate_runs(
    lm: SafeEnsembleLM, jobs: list[Any], batch_sizes: list[int]
) -> dict[str, list[dict[str, Any]]]:
    """transformers ``generate`` of each member alone on the same jobs (its own chat template and
    prompt ids, greedy, stopping at its EOS as a user runs it), ``batch_size`` prompts at a time
    (left-padded), at each batch size: the batching gain a member gets on its own, the yardstick
    for the ensemble's."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for member in lm.members:
        prompts = [lm.decoder.prompt_ids(member, job[0], job[2]) for job in jobs]
        pad = member.tokenizer.pad_token_id
        pad = member.eos_id if pad is None else pad
        tools = instruments(member)
        tools.generate(member, prompts[:2], 4, pad)  # warm-up
        runs[member.name] = []
        for bs in batch_sizes:
            chunks = [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
            _, seconds = timed(
                partial(_generate_chunks, tools.generate, member, chunks, jobs[0][2], pad), [member]
            )
            runs[member.name].append({"batch_size": bs, "seconds": seconds})
            print(f"{member.name} generate batch_size={bs:<3d} {seconds:8.1f}s", flush=True)
    return runs


def _generate_chunks(
    generate: Any, member: Any, chunks: list[list[list[int]]], new_tokens: int, pad: int
) -> None:
    for chunk in chunks:
        generate(member, chunk, new_tokens, pad)


def first_divergence(a: str, b: str) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def load_lm(args: argparse.Namespace) -> SafeEnsembleLM:
    return SafeEnsembleLM(
        members=args.members,
        schedule=args.schedule,
        aggregator=args.aggregator,
        device=args.device,
        dtype=args.dtype,
    )


def bench_batches(args: argparse.Namespace) -> dict[str, Any]:
    lm = load_lm(args)
    jobs = make_jobs(lm, load_prompts(args.data_dir, "gsm8k", args.prompts), args.max_new_tokens)
    lm.decoder.generate_many(jobs[:2], max(args.batch_sizes))  # warm-up: lazy init, union cache
    runs = []
    for bs in args.batch_sizes:
        run = timed_run(lm, jobs, bs)
        runs.append(run)
        print(
            f"batch_size={bs:<3d} {run['tokens']:5d} tok {run['seconds']:8.1f}s "
            f"{run['tokens_per_second']:6.2f} tok/s E/T={run['ensemble_rate_percent']:.1f}%",
            flush=True,
        )
    base = runs[0]
    report: dict[str, Any] = {
        "prompts": len(jobs),
        "max_new_tokens": args.max_new_tokens,
        "runs": [],
    }
    for run in runs:
        same = sum(a == b for a, b in zip(run["texts"], base["texts"], strict=True))
        diverge = [
            {"prompt": i, "char": first_divergence(a, b), "batched": a[:200], "unbatched": b[:200]}
            for i, (a, b) in enumerate(zip(run["texts"], base["texts"], strict=True))
            if a != b
        ]
        ratio = run["tokens_per_second"] / base["tokens_per_second"]
        print(
            f"batch_size={run['batch_size']}: throughput x{ratio:.2f} of batch_size={base['batch_size']}; identical texts {same}/{len(jobs)}"
        )
        for d in diverge:
            print(f"  prompt {d['prompt']} diverges at char {d['char']}")
        report["runs"].append(
            {k: v for k, v in run.items() if k != "texts"}
            | {"throughput_ratio": ratio, "identical": same, "diverging": diverge}
        )
    if args.no_generate:
        return report
    # the members' own batching gain on the same prompts, same run: the ensemble's gain over it
    generated = member_generate_runs(lm, jobs, args.batch_sizes)
    report["generate"] = generated
    for i, run in enumerate(report["runs"][1:], start=1):
        gains = {name: rows[0]["seconds"] / rows[i]["seconds"] for name, rows in generated.items()}
        mean_gain = sum(gains.values()) / len(gains)
        run["generate_gains"] = gains
        run["gain_over_members"] = run["throughput_ratio"] / mean_gain
        each = ", ".join(f"{name} x{gain:.2f}" for name, gain in gains.items())
        print(
            f"batch_size={run['batch_size']}: ensemble gain x{run['throughput_ratio']:.2f}; generate's gain {each}; "
            f"the ensemble's gain is {run['gain_over_members']:.2f} of the members' mean"
        )
        before, after = time_parts(report["runs"][0]), time_parts(run)
        run["part_gains"] = {name: before[name] / after[name] if after[name] > 0 else None for name in after}
        parts = ", ".join(
            f"{name} {before[name]:.1f}s -> {after[name]:.1f}s (x{gain:.2f})"
            for name, gain in run["part_gains"].items()
            if gain is not None
        )
        print(f"  inside the ensemble, batch_size=1 -> {run['batch_size']}: {parts}")
    return report


def dp_worker(args: argparse.Namespace) -> None:
    """One torchrun rank: its share of the prompts, its decoding time written to --out."""
    import torch.distributed as dist

    lm = load_lm(args)  # joins the process group from torchrun's environment
    rank, world = lm.rank, lm.world_size
    jobs = make_jobs(lm, load_prompts(args.data_dir, "gsm8k", args.prompts), args.max_new_tokens)
    lm.decoder.generate_many(jobs[:1], 1)  # warm-up
    dist.barrier()
    run = timed_run(lm, jobs[rank::world], args.dp_batch_size)
    parts = [None] * world
    dist.all_gather_object(parts, {k: v for k, v in run.items() if k != "texts"})
    if rank == 0:
        args.out.write_text(json.dumps(parts))


def bench_dp(args: argparse.Namespace) -> dict[str, Any]:
    threads = torch.get_num_threads()
    lm = load_lm(args)
    jobs = make_jobs(lm, load_prompts(args.data_dir, "gsm8k", args.prompts), args.max_new_tokens)
    lm.decoder.generate_many(jobs[:1], 1)
    single = timed_run(lm, jobs, args.dp_batch_size)
    del lm
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dp.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "-m", "lm_eval_safe.cli", "bench", "batch", "--dp-worker", "--out", str(out),
            "--members", args.members, "--prompts", str(args.prompts),
            "--max-new-tokens", str(args.max_new_tokens), "--schedule", args.schedule,
            "--aggregator", args.aggregator, "--dp-batch-size", str(args.dp_batch_size),
            "--data-dir", str(args.data_dir), "--dtype", args.dtype, "--device", args.device,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, threads // 2)))
        subprocess.run(command, check=True, env=env)
        parts = json.loads(out.read_text())
    dp_seconds = max(p["seconds"] for p in parts)
    ratio = single["seconds"] / dp_seconds
    print(
        f"data parallel: 1 process x {threads} threads {single['seconds']:.1f}s; "
        f"2 processes x {max(1, threads // 2)} threads {dp_seconds:.1f}s (slowest rank); "
        f"wall-time ratio 1p/2p = {ratio:.2f}"
    )
    return {
        "single_seconds": single["seconds"],
        "dp_seconds": dp_seconds,
        "speedup": ratio,
        "ranks": parts,
    }


def configure(p: argparse.ArgumentParser) -> None:
    add_members(p)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--schedule", default="safe")
    p.add_argument("--aggregator", default="unite")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    add_data_dir(p)
    p.add_argument(
        "--no-generate",
        action="store_true",
        help="skip transformers generate's own batching gain on each member",
    )
    p.add_argument("--dp", action="store_true", help="also compare 2 data-parallel processes")
    p.add_argument("--dp-only", action="store_true", help="only the data-parallel comparison")
    p.add_argument("--dp-batch-size", type=int, default=1)
    p.add_argument("--dp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, dest="json_out")


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench batch`` with a plain argument list."""
    return commands.main("batch", argv)


def run(args: argparse.Namespace) -> int:
    args.batch_sizes = [int(b) for b in split_list(args.batch_sizes)]
    args.data_dir = local_data_dir(args.data_dir, "lm-eval-safe bench batch")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dp_worker:
        dp_worker(args)
        return 0
    report: dict[str, Any] = {
        "members": args.members,
        "schedule": args.schedule,
        "aggregator": args.aggregator,
    }
    if not args.dp_only:
        report["batching"] = bench_batches(args)
    if args.dp or args.dp_only:
        report["data_parallel"] = bench_dp(args)
    if args.json_out:
        write_json_report(args.json_out, report)
    return 0
