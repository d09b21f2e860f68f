"""Several evaluations on one machine: the README's main job under each thread setting, alone
and two at once, whole ``lm_eval`` processes timed from start to exit.

Why it measures what it does
----------------------------
* torch's CPU kernels run on an OpenMP pool (GNU OpenMP in the PyPI wheels) with one thread per
  core. Between two kernels its threads spin for a while before they sleep (``GOMP_SPINCOUNT``,
  ``OMP_WAIT_POLICY``): alone, that saves a wake-up per kernel; with a second process on the
  same cores, each spinning thread takes a core the other process's threads wait for.
* The job is the README's (``safe_gsm8k``, chat template, the default members, batch 1), smaller
  by default (``--limit``, ``--max-gen-toks``) so that a pair of slow runs ends in minutes. A
  setting is environment variables given to both processes; each row runs it alone, then two
  copies started together, and states the pair's slowdown against the same setting alone and
  against the default alone (the time a user waits for one evaluation).
* Whole processes (start-up, loading, lm-eval's own work included), as a user experiences them;
  each run writes to its own temporary folder.

Example (alone on the machine)::

    .venv/bin/lm-eval-safe bench threads --json benchmarks/threads/main_job.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lm_eval_safe
from lm_eval_safe.bench import commands
from lm_eval_safe.bench.output import write_json_report
from lm_eval_safe.cli_options import add_data_dir, add_members, local_data_dir

#: name -> environment variables of the setting (the default: none set)
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin-10k": {"GOMP_SPINCOUNT": "10000"},
    "one-thread": {"OMP_NUM_THREADS": "1"},
}


def configure(p: argparse.ArgumentParser) -> None:
    add_members(p)
    add_data_dir(p)
    p.add_argument("--limit", type=int, default=2, help="GSM8K questions per run")
    p.add_argument("--max-gen-toks", type=int, default=128)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"from {', '.join(SETTINGS)}")
    p.add_argument("--json", type=Path, default=None, dest="json_out")


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench threads`` with a plain argument list."""
    return commands.main("threads", argv)


def command(args: argparse.Namespace, output: Path) -> list[str]:
    """The README's main job as a user types it, smaller."""
    return [
        sys.executable, "-m", "lm_eval",
        "--model", "safe-ensemble",
        "--model_args", f"members={args.members}",
        "--tasks", "safe_gsm8k",
        "--include_path", str(lm_eval_safe.task_dir()),
        "--metadata", json.dumps({"data_dir": str(args.data_dir)}),
        "--apply_chat_template",
        "--gen_kwargs", f"max_gen_toks={args.max_gen_toks}",
        "--limit", str(args.limit),
        "--output_path", str(output),
    ]  # fmt: skip


def run_together(args: argparse.Namespace, setting: dict[str, str], copies: int) -> list[float]:
    """``copies`` processes of the job started at once under ``setting``; each one's seconds."""
    environment = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
    }
    environment.update(commands.ENVIRONMENT | setting)
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        processes = [
            subprocess.Popen(
                command(args, Path(scratch) / str(i)),
                env=environment,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(copies)
        ]
        seconds = []
        for process in processes:
            _, error = process.communicate()
            seconds.append(time.perf_counter() - start)
            if process.returncode:
                raise RuntimeError(
                    f"lm_eval failed under {setting or 'the default'}: {error.strip().splitlines()[-1:]}"
                )
    return seconds


def run(args: argparse.Namespace) -> int:
    args.data_dir = local_data_dir(args.data_dir, "lm-eval-safe bench threads")
    names = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"unknown setting {unknown}; choose from {sorted(SETTINGS)}")
    rows: list[dict[str, Any]] = []
    for name in names:
        (alone,) = run_together(args, SETTINGS[name], 1)
        pair = run_together(args, SETTINGS[name], 2)
        rows.append(
            {"setting": name, "environment": SETTINGS[name], "alone_s": alone, "pair_s": pair}
        )
        print(
            f"{name}: alone {alone:.1f}s, two at once {max(pair):.1f}s", file=sys.stderr, flush=True
        )
    default_alone = next((r["alone_s"] for r in rows if r["setting"] == "default"), None)
    print(
        "| setting | environment | alone s | vs default alone | two at once s (slower) | pair vs alone | pair vs default alone |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        pair = max(r["pair_s"])
        versus = (lambda s: f"{s / default_alone:.2f}x") if default_alone else (lambda s: "-")
        environment = " ".join(f"{k}={v}" for k, v in r["environment"].items()) or "(none)"
        print(
            f"| {r['setting']} | {environment} | {r['alone_s']:.1f} | {versus(r['alone_s'])} | {pair:.1f} | "
            f"{pair / r['alone_s']:.2f}x | {versus(pair)} |"
        )
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        write_json_report(
            args.json_out,
            {
                "members": args.members,
                "limit": args.limit,
                "max_gen_toks": args.max_gen_toks,
                "cpus": os.cpu_count(),
                "rows": rows,
            },
        )
    return 0
