"""Speed benchmark of SAFE against the drafter alone and the every-token / threshold baselines.

Why it measures what it does
----------------------------
The paper's latency claim (docs/algorithm.md, The paper's numbers) is that SAFE "closely matches the latency of
individual models" and is far faster than ensembling every token; its Caches section says verifier KV-cache
reuse is what makes that possible. Absolute tokens/s on a shared 2-core CPU mean little, so
every number that matters here is a *ratio of per-token times measured side by side*:

* Members are loaded once; every method then runs on the same prompt back to back
  (prompt 1: A, B, C, ...; prompt 2: A, B, C, ...), so drift of the machine (other jobs,
  thermal state) hits all methods alike. Ratios are computed per (prompt, repeat) pair and
  aggregated as a median (robust to a burst of load) and as total-time / total-tokens.
* Decoding is greedy, with the same ``max_new_tokens`` and no stop string but EOS, so all
  methods generate comparable lengths (time is normalised per generated token anyway).
* ``hf_generate`` (transformers ``generate`` of the drafter alone) is the reference a user
  would otherwise run. ``drafter`` is the same through :class:`SafeDecoder` (its overhead is
  the decoder's own bookkeeping; its text must equal ``hf_generate``'s).
* ``floor`` is the least any draft-then-verify scheme can cost: the drafter's own decoding
  plus one verifier forward per cycle over only the new verifier tokens (with cache reuse,
  through ``VerifierRun.sync``), and nothing else. ``safe_*/floor`` is therefore the overhead
  of SAFE's policy (alignment checks, aggregation, rewinds), which should stay close to 1.
* ``every`` vs ``every_nocache`` and ``safe_unite`` vs ``safe_nocache`` isolate the value of
  the verifier cache (docs/algorithm.md, Caches: without it the ensemble is several times slower).
* E/T, acceptance and verifier positions recomputed per token (docs/algorithm.md, Statistics) explain the times: a
  method that recomputes many verifier positions per token, or ensembles often, is slow.
* Memory: the process's max RSS (``ru_maxrss``) after each method -- monotone, so it only
  shows which method first raised the peak -- plus ``torch.cuda.max_memory_allocated`` per
  method on GPU. ``tracemalloc`` does not see torch's allocations, so it is not used.
* ``safe_*_overlap`` run ``overlap=on`` (verifier threads beside the next draft): on a CPU the
  members share the cores, so this measures whether splitting them pays on this machine.
* The latency model (:mod:`lm_eval_safe.bench.latency_model`): each member's forward over 1
  and 5 new tokens is timed once before the loop, and each decoder run's counted forwards are
  priced with those latencies, in turn and overlapped (verifiers on their own devices). The
  modelled ratios are printed apart from the measured ones and labelled as a model: they say
  what a latency-bound device would give, not what this machine does.
* The union vocabulary (gac only) is built once per member set: its build time is reported
  uncached and then cached on disk (first build writes, second loads), and it is built before
  timing so that no method pays for it inside the loop.

Example::

    HF_HUB_OFFLINE=1 .venv/bin/lm-eval-safe bench speed --prompts 2 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lm_eval_safe.bench import commands
from lm_eval_safe.bench.eos import mask_eos
from lm_eval_safe.bench.latency_model import measure_latency
from lm_eval_safe.bench.memory import rss_mib
from lm_eval_safe.bench.output import write_json_report
from lm_eval_safe.bench.prompts import DATASET_FIELDS, load_prompts
from lm_eval_safe.bench.speed import (
    METHODS,
    make_decoder,
    run_method,
    time_methods,
    time_union,
)
from lm_eval_safe.bench.speed_report import markdown, modelled, ratios, summarise
from lm_eval_safe.cli_options import (
    add_data_dir,
    add_drafter,
    add_engine,
    add_members,
    local_data_dir,
    split_list,
)
from lm_eval_safe.decoder.loop import SafeDecoder
from lm_eval_safe.engines import load_member
from lm_eval_safe.members.member import Member
from lm_eval_safe.model_args import resolve_drafter_index

#: engine options this benchmark sets where the engine claims them: no shared-prefix store,
#: or every method would reuse the prompt the method before it prefilled
#: (lm-eval-safe bench eval measures reuse across requests)
BENCH_DEFAULTS = {"prefix_cache_mb": 0}


def configure(p: argparse.ArgumentParser) -> None:
    add_members(p)
    add_drafter(p)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dataset", choices=sorted(DATASET_FIELDS), default="gsm8k")
    add_data_dir(p)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--draft-len", type=int, default=5)
    p.add_argument("--shots", type=int, default=0, help="solved problems before each prompt")
    add_engine(
        p,
        "the engine's own model_args, e.g. fast_small_linear=off (the transformers engine's "
        f"shared-prefix store is off unless given: {BENCH_DEFAULTS})",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument(
        "--member-devices",
        default=None,
        help="one device per member, e.g. cuda:0,cuda:1: where overlap=auto turns on, so the "
        "safe_*_overlap methods measure the real ratio the latency model predicts",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="mask every member's EOS so all methods generate exactly --max-new-tokens "
        "(speed only; SmolLM2-Instruct otherwise ends a plain-text prompt at once)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the short untimed warm-up")
    p.add_argument(
        "--no-latency-model",
        action="store_true",
        help="skip measuring 1- and 5-row forward latencies and the modelled GPU ratios",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="METHOD",
        help="after the benchmark, cProfile METHOD on the first prompt and print the top entries",
    )
    p.add_argument("--json", type=Path, default=None, dest="json_out")
    p.add_argument("--markdown", type=Path, default=None, dest="markdown_out")


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """The methods listed and checked, the data folder found."""
    args.method_list = split_list(args.methods)
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown:
        raise SystemExit(f"lm-eval-safe bench speed: unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if args.profile and args.profile not in METHODS:
        raise SystemExit(f"lm-eval-safe bench speed: --profile {args.profile!r} is not a method")
    args.data_dir = local_data_dir(args.data_dir, "lm-eval-safe bench speed")
    return args


def engine_settings(args: argparse.Namespace, specs: list[str]) -> dict:
    """``--engine``'s own loading settings: ``--engine-args`` over :data:`BENCH_DEFAULTS` (the
    keys it claims), checked by the engine's spec as ``--model_args`` are."""
    from lm_eval_safe.engines import engine
    from lm_eval_safe.model_args import parse_model_args
    from lm_eval_safe.options import parse_options

    spec = engine(args.engine)
    given = {key: value for key, value in BENCH_DEFAULTS.items() if key in spec.options}
    given.update(parse_model_args(args.engine_args))
    return spec.member_settings(parse_options({"members": specs, "engine": args.engine, **given}))


def load_members(args: argparse.Namespace, specs: list[str]) -> tuple[list[Member], float]:
    """Every member, once (``--member-devices``: one device each), with the seconds it took."""
    devices = [d.strip() for d in args.member_devices.split(",")] if args.member_devices else None
    if devices is not None and len(devices) != len(specs):
        raise SystemExit(f"--member-devices names {len(devices)} devices for {len(specs)} members")
    settings = engine_settings(args, specs)
    start = time.perf_counter()
    members = [
        load_member(
            spec,
            engine=args.engine,
            index=i,
            device=devices[i] if devices else args.device,
            dtype=args.dtype,
            **settings,
        )
        for i, spec in enumerate(specs)
    ]
    return members, time.perf_counter() - start


def make_decoders(
    args: argparse.Namespace, members: list[Member], drafter_index: int, base: dict[str, Any]
) -> dict[str, SafeDecoder]:
    """A decoder per method (``_base``: the default options, for prompts and the drafter
    alone), each GaC ensemble's union vocabulary built outside the timed loop."""
    decoders = {"_base": make_decoder(members, drafter_index, base, {})}
    for method in args.method_list:
        overrides = METHODS[method]
        if overrides is not None:
            decoders[method] = make_decoder(members, drafter_index, base, overrides)
            if overrides.get("schedule") != "drafter":  # GaC's union (disk-cached) outside the timed loop
                decoders[method].ensembler.aggregator.prepare()
    return decoders


def build_report(
    args: argparse.Namespace,
    specs: list[str],
    members: list[Member],
    drafter_index: int,
    prompts: list[str],
    timings: dict[str, Any],
) -> dict[str, Any]:
    """The JSON report: the configuration, then ``timings`` (load, union vocabulary, latency
    model, runs) summarised."""
    runs, latencies, in_decoder_order = timings["runs"], timings["latencies"], timings["in_decoder_order"]
    return {
        "config": {
            "members": ",".join(specs),
            "drafter": members[drafter_index].name,
            "dataset": args.dataset,
            "prompts": len(prompts),
            "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens,
            "draft_len": args.draft_len,
            "shots": args.shots,
            "engine": args.engine,
            **engine_settings(args, specs),
            "methods": args.method_list,
            "device": ",".join(str(m.device) for m in members),
            "dtype": str(members[0].dtype).replace("torch.", ""),
            "torch_threads": torch.get_num_threads(),
            "ignore_eos": args.ignore_eos,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "load_seconds": timings["load_seconds"],
        "union_vocabulary": timings["union_times"],
        "methods": summarise(runs, args.method_list),
        "ratios": ratios(runs, args.method_list),
        "forward_latency": {
            m.name: vars(lat) for m, lat in zip(in_decoder_order, latencies or [], strict=False)
        },
        "modelled": modelled(runs, args.method_list) if latencies else [],
        "current_rss_mib_end": rss_mib(),
        "runs": [
            {k: v for k, v in vars(r).items()} | {"per_token_seconds": r.per_token} for r in runs
        ],
    }


def profile(args: argparse.Namespace, decoders: dict[str, SafeDecoder], members: list[Member], prompt: str) -> None:
    """``--profile``: cProfile one method on the first prompt, the top entries to stderr."""
    profiler = cProfile.Profile()
    profiler.enable()
    run_method(args.profile, decoders, members, prompt, args.max_new_tokens)
    profiler.disable()
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).sort_stats("cumulative").print_stats(30)
    print(f"\n### cProfile of {args.profile} (cumulative, top 30)\n", file=sys.stderr)
    print(buffer.getvalue(), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench speed`` with a plain argument list."""
    return commands.main("speed", argv)


def run(args: argparse.Namespace) -> int:
    args = finish_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [s.strip() for s in args.members.split(",") if s.strip()]
    drafter_index = resolve_drafter_index(args.drafter, specs)
    prompts = load_prompts(args.data_dir, args.dataset, args.prompts, args.shots)
    base = {
        "members": specs,
        "drafter": str(drafter_index),
        "draft_len": args.draft_len,
        "dtype": args.dtype,
    }
    members, load_seconds = load_members(args, specs)
    if args.ignore_eos:
        mask_eos(members)
    print(f"loaded {', '.join(m.name for m in members)} in {load_seconds:.1f}s", file=sys.stderr)

    union_times = time_union(members, drafter_index)
    decoders = make_decoders(args, members, drafter_index, base)
    if not args.no_warmup:  # first calls pay for lazy initialisation; keep that out of timings
        for method in args.method_list:
            run_method(method, decoders, members, prompts[0], min(8, args.max_new_tokens))

    latencies = None
    in_decoder_order = [decoders["_base"].drafter, *decoders["_base"].verifiers]
    if not args.no_latency_model:  # before the timed loop, never inside it
        latencies = [
            measure_latency(m, decoders["_base"].prompt_ids(m, prompts[0], args.max_new_tokens))
            for m in in_decoder_order
        ]
    runs = time_methods(
        args.method_list, decoders, members, prompts, args.max_new_tokens, args.repeats, latencies
    )
    timings = {
        "load_seconds": load_seconds,
        "union_times": union_times,
        "runs": runs,
        "latencies": latencies,
        "in_decoder_order": in_decoder_order,
    }
    report = build_report(args, specs, members, drafter_index, prompts, timings)
    table = markdown(report)
    print(table)
    if args.markdown_out:
        args.markdown_out.write_text(table, encoding="utf-8")
    if args.json_out:
        write_json_report(args.json_out, report)
    if args.profile:
        profile(args, decoders, members, prompts[0])
    return 0

