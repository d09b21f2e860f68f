"""Memory of a long generation run: RSS after 50, 100 and 200 requests.

Why it measures what it does
----------------------------
* A long evaluation must not grow per request: verifier rows, KV caches, statistics and
  caches all have to be freed or bounded. The script sends ``--requests`` generate requests
  through ``SafeEnsembleLM.generate_until`` (the path lm-eval takes, batching and the cache
  hook included) and samples the process at chosen request counts.
* Samples are taken when a request finishes, from the cache hook lm-eval itself would be
  handed (``add_partial``), so the run is one call as in lm-eval, not many small ones.
* Four numbers per sample: RSS (what the OS charges, allocator slack included), RSS after
  ``malloc_trim`` (slack returned: what is really in use), the bytes of live torch tensors (weights plus KV caches and kept distributions: the part a leak in the
  decoder would grow), and the count of live Python objects (a per-request leak of dicts or
  lists shows here first). Between the first and last mid-run samples the batch holds the same
  number of rows, so the numbers should be level.
* ``--ignore-eos`` (default on) masks every member's EOS in its output layer, so each request
  generates exactly ``--max-new-tokens`` tokens; batching still applies (the mask is a hook on
  the output layer, which the batched forward calls too). Texts are not answers then.

Example (the real members; ~1 h on 2 CPU cores)::

    .venv/bin/lm-eval-safe bench memory --members smollm2-135m,gemma3-270m \\
        --requests 200 --max-new-tokens 256 --batch-size 8
"""

from __future__ import annotations

import argparse
import time

from lm_eval_safe.bench import commands
from lm_eval_safe.bench.eos import mask_eos
from lm_eval_safe.bench.memory import generate_with_probe, rss_mib
from lm_eval_safe.bench.prompts import load_prompts
from lm_eval_safe.cli_options import add_data_dir, add_members, local_data_dir


def _mib(value: float | None) -> str:
    """A memory figure in whole MiB, or a dash where the platform cannot measure it."""
    return "-" if value is None else f"{value:.0f}"


def configure(parser: argparse.ArgumentParser) -> None:
    add_members(parser)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--at", default="50,100,200", help="request counts to sample at")
    parser.add_argument("--model-args-extra", default="", help="e.g. schedule=every,dtype=float32")
    add_data_dir(parser)
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument(
        "--keep-eos", action="store_true", help="let requests end at EOS (default: masked)"
    )
    parser.add_argument("--threads", type=int, default=None)


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench memory`` with a plain argument list."""
    return commands.main("memory", argv)


def run(args: argparse.Namespace) -> int:
    args.data_dir = local_data_dir(args.data_dir, "lm-eval-safe bench memory")
    import torch

    from lm_eval_safe.harness.model import SafeEnsembleLM
    from lm_eval_safe.model_args import parse_model_args

    if args.threads:
        torch.set_num_threads(args.threads)
    at = sorted({int(x) for x in args.at.split(",") if x})
    extra = parse_model_args(args.model_args_extra)
    started = time.perf_counter()
    lm = SafeEnsembleLM(members=args.members, batch_size=args.batch_size, **extra)
    print(f"loaded {args.members} in {time.perf_counter() - started:.0f}s, RSS {_mib(rss_mib())} MiB")
    if not args.keep_eos:
        mask_eos(lm.members)
    prompts = load_prompts(args.data_dir, "gsm8k", args.requests, cycle=True)
    contexts = (
        prompts
        if args.no_chat_template
        else [lm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    )
    before = rss_mib()
    start = time.perf_counter()
    probe, _ = generate_with_probe(lm, contexts, args.max_new_tokens, at)
    stats = lm.run_stats
    print(
        f"{args.requests} requests x {args.max_new_tokens} new tokens, batch_size "
        f"{args.batch_size}, members {args.members}, torch threads {torch.get_num_threads()}: "
        f"{stats.generated_tokens} tokens in {time.perf_counter() - start:.0f}s "
        f"(E/T {stats.ensemble_rate:.2f}%); RSS before the first request {_mib(before)} MiB"
    )
    print(
        "| requests done | RSS MiB | RSS after malloc_trim MiB | live tensors MiB | Python objects |"
    )
    print("|---:|---:|---:|---:|---:|")
    for count, sample in sorted(probe.samples.items()):
        print(
            f"| {count} | {_mib(sample['rss_mib'])} | {_mib(sample['trimmed_rss_mib'])} | "
            f"{sample['tensor_mib']:.1f} | {sample['objects']} |"
        )
    print(f"request_stats kept: {len(lm.request_stats)} (bounded)")
    return 0

