"""Host work per generated token: wall time minus the time inside the members' forwards, and
the device-to-host synchronisations the host code asks for.

Why it measures what it does
----------------------------
* On a GPU the forwards shrink and the Python between them does not: the host time per
  generated token (per request: batching does not amortise it) is what leaves a device idle.
  :mod:`lm_eval_safe.bench.host_work` clocks the forwards with module hooks (outermost call
  once) and counts every read of a tensor computed from a member's weights (each is a
  synchronisation on a GPU, free on a CPU), inside and outside the forwards.
* Configurations: the drafter alone, UniTE+SAFE and GaC+SAFE, on the same few-shot GSM8K
  prompts (bare prompts make instruct members stop at once), at each batch size, back to back
  in one process after an untimed warm-up. The sync-counting pass repeats each run (the counter
  slows torch calls) and must write the same texts.
* The device work between the forwards, which a GPU runs asynchronously in microseconds and
  this CPU computes in line, is timed in the same pass: the KV-cache moves and the heads (the
  log-softmax, argmax and top-k cut from each forward's logits over a whole vocabulary, the
  wider heads and full rows asked for later). *Less KV moves and heads* is the host time a
  GPU's host would still pay: Python, host tensors, reads. The counted pass counts the kernels
  launched between the forwards (*device ops*), which that host pays a launch each for too.
* The host time is a small difference of two large ones and this VM's memory traffic varies
  from run to run (KV moves by up to 2x): each row is timed ``--repeats`` times and the run
  with the median host time is reported, every repeat's host time beside it.
* Drafts as a GPU runs them (``--drafts on-device``): a greedy window's tokens stay on the
  device and come back in one read at its end, which is what the read counts are for; a CPU
  reads each token instead (free there), ``--drafts read-each``.
* Greedy decoding, stop string ``Question:`` (the few-shot format), ``--max-new-tokens`` each.
* Each configuration is stated against the drafter alone at the same batch size, same run:
  host time and device ops per token (the two figures SAFE's own work is judged by).
  A second table takes the device-op ratio apart: forwards per token (the verifiers' own, drafts
  a replacement threw away, and *rows per forward*: the batch-1 run's forwards over this one's,
  what lock-step cycles give up where rows draft windows of different lengths) times device
  ops per forward (the heads cut from each).
  A third replays each batched run's own cycles (:mod:`lm_eval_safe.bench.batch_packing`): as
  the driver batches them (it must give the forwards counted), with rows in different phases
  of their cycles, and the fewest forwards any schedule of the same cycles could run, so a
  change to the driver is judged before it is written: the bound against the drafter's
  forwards, and the device ops it would leave at this run's ops per forward.
  ``--profile CONFIG:BATCH`` then samples one run (:mod:`lm_eval_safe.bench.host_profile`) and
  says where the host time went, by part of the cycle.
* On a GPU (``--device cuda``) every clock times the device's stream with CUDA events (the host's
  time inside an asynchronous call is its launches only), so *host ms/token* is the device's
  time outside the forwards per token: its idle time plus the few kernels between forwards,
  the figure that decides whether a GPU stays busy, measured rather than estimated. (The columns that subtract
  the KV moves and heads there also subtract the host's launches inside those functions.)

Example (alone on the machine)::

    .venv/bin/lm-eval-safe bench host --json benchmarks/host_work/host_work.json
    lm-eval-safe bench host --device cuda --repeats 5 --json host_work_gpu.json   # a GPU
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

from lm_eval_safe.bench import commands
from lm_eval_safe.bench.host_profile import profile_run, profile_table
from lm_eval_safe.bench.host_work import CONFIGURATIONS, count_reads, measure, median_run
from lm_eval_safe.bench.output import fmt, write_json_report
from lm_eval_safe.bench.prompts import load_prompts
from lm_eval_safe.cli_options import (
    DEFAULT_MEMBERS,
    add_data_dir,
    add_drafter,
    add_members,
    local_data_dir,
    members_with_drafter_first,
    split_list,
)
from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.engines import load_member
from lm_eval_safe.options import parse_options

#: the drafter with the default members (they list it second, in the README's order)
DEFAULT_DRAFTER = "gemma3-270m"


def configure(p: argparse.ArgumentParser) -> None:
    add_members(p)
    add_drafter(p, help_default=f"{DEFAULT_DRAFTER} with the default members, else the first member")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--shots", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--configurations", default=",".join(CONFIGURATIONS))
    add_data_dir(p)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default=None, help="every member's device (default: the loader's: cuda if any)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the members' dtype (auto: bfloat16 on cuda, float32 elsewhere)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed passes per row (the median's is kept)")
    p.add_argument(
        "--drafts",
        choices=("auto", "on-device", "read-each"),
        default="auto",
        help="greedy draft windows kept on the device and read back once (a GPU's way), or every "
        "drafted token read back (a CPU's way); auto: the members' device decides",
    )
    p.add_argument("--no-syncs", action="store_true", help="skip the sync-counting pass")
    p.add_argument(
        "--profile",
        default=None,
        metavar="CONFIG:BATCH",
        help="after the table, where one run's host time goes by part of the cycle (needs pyinstrument)",
    )
    p.add_argument("--json", type=Path, default=None, dest="json_out")


def member_specs(args: argparse.Namespace) -> list[str]:
    """The members, the drafter first (the decoders below draft with member 0)."""
    drafter = args.drafter if args.drafter is not None else DEFAULT_DRAFTER if args.members == DEFAULT_MEMBERS else "0"
    return members_with_drafter_first(split_list(args.members), drafter)


def host_cell(row: dict) -> str:
    """The median repeat's host ms/token, and the range of all repeats."""
    repeats = row["host_ms_per_token_repeats"]
    if len(repeats) < 2:
        return fmt(row["host_ms_per_token"])
    return f"{fmt(row['host_ms_per_token'])} ({fmt(min(repeats))}-{fmt(max(repeats))})"


def ratio_to_drafter(row: dict, rows: list[dict], key: str) -> str:
    """``row[key]`` over the drafter alone's at the same batch size, in the same run (the
    figure SAFE's own work is judged by), or "-" without that row or that count."""
    base = next((r for r in rows if r["configuration"] == "drafter" and r["batch_size"] == row["batch_size"]), None)
    if base is None or not base.get(key) or row.get(key) is None:
        return "-"
    return f"{row[key] / base[key]:.2f}x"


def table(rows: list[dict]) -> str:
    lines = [
        "| configuration | batch | tokens | wall s | forwards s | KV moves s | heads s | host ms/token "
        "| **host vs drafter** | less KV moves | **less KV moves and heads** | device ops/token "
        "| **device ops vs drafter** | host syncs/token "
        "| host syncs per forward (per engine call) | syncs/token in forwards |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        per_call = ", ".join(
            f"{name} {per_forward} ({r['host_syncs_per_engine_call'][name]})"
            for name, per_forward in r["host_syncs_per_forward"].items()
        )
        lines.append(
            f"| {r['configuration']} | {r['batch_size']} | {r['tokens']} | {fmt(r['wall_s'])} | "
            f"{fmt(r['forward_s'])} | {fmt(r['cache_move_s'])} | {fmt(r['heads_s'])} | {host_cell(r)} | "
            f"{ratio_to_drafter(r, rows, 'host_ms_per_token')} | "
            f"{fmt(r['host_ms_per_token_less_cache_moves'])} | {fmt(r['host_ms_per_token_less_device_work'])} | "
            f"{fmt(r['device_ops_per_token'])} | {ratio_to_drafter(r, rows, 'device_ops_per_token')} | "
            f"{fmt(r['host_syncs_per_token'])} | {per_call} | "
            f"{fmt(r['forward_syncs_per_token'])} |"
        )
    return "\n".join(lines)


def rows_per_forward(row: dict, rows: list[dict]) -> str:
    """How many requests a forward carried on average: the forwards the same configuration ran
    at batch size 1 in this run (each request's own, one row each) over this row's, or "-"
    without that row. At batch size ``b`` it is at most ``b``; SAFE's lock-step cycles give up
    the rest where rows draft windows of different lengths, or wait for a verifier."""
    alone = next(
        (r for r in rows if r["configuration"] == row["configuration"] and r["batch_size"] == 1), None
    )
    if alone is None or alone["texts"] != row["texts"] or not sum(row["forwards"].values()):
        return "-"
    return f"{sum(alone['forwards'].values()) / sum(row['forwards'].values()):.2f}"


def forwards_table(rows: list[dict]) -> str:
    """The device-op ratio taken apart: forwards per token (a ratio a schedule sets: the
    verifiers' forwards, drafts thrown away, rows a batched forward leaves out) times device
    ops per forward (the work cut from each forward's logits)."""
    lines = [
        "| configuration | batch | forwards/token | forwards vs drafter | rows per forward "
        "| device ops/forward | ops per forward vs drafter | device ops vs drafter |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['configuration']} | {r['batch_size']} | {fmt(r['forwards_per_token'], 3)} | "
            f"{ratio_to_drafter(r, rows, 'forwards_per_token')} | {rows_per_forward(r, rows)} | "
            f"{fmt(r['device_ops_per_forward'])} | {ratio_to_drafter(r, rows, 'device_ops_per_forward')} | "
            f"{ratio_to_drafter(r, rows, 'device_ops_per_token')} |"
        )
    return "\n".join(lines)


def packing_table(rows: list[dict]) -> str:
    """What another batch driver could save (:mod:`lm_eval_safe.bench.batch_packing`): each
    batched run's own cycles replayed, as the driver runs them (the forwards counted, a check of
    the replay), with rows in different phases of their cycles (at the ``verify_at`` that runs
    the fewest forwards), and the fewest forwards any schedule of them runs; that bound against
    the drafter alone's forwards, and the device ops it would leave at this run's ops per forward."""
    lines = [
        "| configuration | batch | drafts/token | forwards/token as run | lock-step replay "
        "| rows apart (verify_at) | **bound** | bound vs drafter | device ops vs drafter at the bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        packing = r.get("packing")
        if r["batch_size"] == 1 or r["configuration"] == "drafter" or not packing:
            continue
        base = next((b for b in rows if b["configuration"] == "drafter" and b["batch_size"] == r["batch_size"]), None)
        bound = packing["bound_forwards_per_token"]
        versus = ops = "-"
        if base is not None:
            versus = f"{bound / base['forwards_per_token']:.2f}x"
            if r["device_ops_per_forward"] is not None and base["device_ops_per_token"]:
                ops = f"{bound * r['device_ops_per_forward'] / base['device_ops_per_token']:.2f}x"
        lines.append(
            f"| {r['configuration']} | {r['batch_size']} | {fmt(packing['drafts_per_token'], 3)} | "
            f"{fmt(r['forwards_per_token'], 3)} | {fmt(packing['lock_step_forwards_per_token'], 3)} | "
            f"{fmt(packing['rows_apart_forwards_per_token'], 3)} ({packing['rows_apart_verify_at']}) | "
            f"{fmt(bound, 3)} | {versus} | {ops} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench host`` with a plain argument list."""
    return commands.main("host", argv)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = member_specs(args)
    args.data_dir = local_data_dir(args.data_dir, "lm-eval-safe bench host")
    members = [load_member(spec, index=i, device=args.device, dtype=args.dtype) for i, spec in enumerate(specs)]
    for member in members:
        member.engine.keep_drafts_on_device = {"auto": None, "on-device": True, "read-each": False}[args.drafts]
    prompts = load_prompts(args.data_dir, "gsm8k", args.prompts, args.shots)
    jobs = [GenerationJob(p, ["Question:"], args.max_new_tokens) for p in prompts]
    configurations = [c.strip() for c in args.configurations.split(",") if c.strip()]
    unknown = sorted(set(configurations) - set(CONFIGURATIONS))
    if unknown:
        raise SystemExit(f"unknown configuration {unknown}; choose from {sorted(CONFIGURATIONS)}")
    decoders = {
        name: SafeDecoder(members, 0, parse_options({"members": specs, **CONFIGURATIONS[name]}))
        for name in configurations
    }
    for decoder in decoders.values():  # lazy set-up (union vocabulary, small-row timings) untimed
        if decoder.schedule.needs_verifiers:
            decoder.ensembler.aggregator.prepare()
        for batch_size in (1, 2):  # the batched path checks each model's output layer once
            decoder.generate_many([GenerationJob(p, ["Question:"], 4) for p in prompts[:2]], batch_size)
    runs = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for name in configurations:
            repeats = []
            for _ in range(args.repeats):  # the rounds interleave nothing else: one row's runs
                work = measure(name, decoders[name], jobs, batch_size, count_syncs=False)
                repeats.append(work)
                print(
                    f"{name} batch {batch_size}: {work.tokens} tokens, wall {work.wall_seconds:.2f}s, "
                    f"forwards {work.forward_seconds:.2f}s, host {work.host_ms_per_token:.2f} ms/token",
                    file=sys.stderr,
                    flush=True,
                )
            runs.append(median_run(repeats))
    if not args.no_syncs:  # after every timed pass: the counter's work never precedes a timing
        for work in runs:
            count_reads(work, decoders[work.configuration], jobs)
            print(f"{work.configuration} batch {work.batch_size}: reads {work.host_syncs}", file=sys.stderr, flush=True)
    rows = [work.summary() | {"texts": work.texts} for work in runs]
    print(table(rows))
    print("\nforwards per token and device ops per forward (their product is device ops per token)")
    print(forwards_table(rows))
    print("\nthe same cycles batched otherwise: forwards per token (lm_eval_safe.bench.batch_packing)")
    print(packing_table(rows))
    if args.json_out:
        report = {
            "config": {
                "members": specs,
                "prompts": args.prompts,
                "shots": args.shots,
                "max_new_tokens": args.max_new_tokens,
                "drafts": args.drafts,
                "device": str(members[0].engine.input_device),
                "dtype": str(members[0].engine.model.dtype),
                "torch_threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cpu_count": os.cpu_count(),
            },
            "rows": rows,
        }
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        write_json_report(args.json_out, report)
    if args.profile:
        name, batch = args.profile.split(":")
        profiled = profile_run(decoders[name], jobs, int(batch))
        print(f"\nwhere the host time goes: {name} at batch {batch} (pyinstrument, forwards cut out)")
        print(profile_table(profiled))
        if args.json_out:
            report["profile"] = {"configuration": name, "batch_size": int(batch)} | profiled
            write_json_report(args.json_out, report)
    return 0

