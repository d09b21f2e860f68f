#!/usr/bin/env python3
"""The GPU check of ``engine=vllm``: parity with lm-eval's own ``--model vllm``, agreement with
the transformers engine, and the whole-run speed ratios, in one short run (under 8 minutes on
one H100/H200 with the default members).

Why it exists: CI and the project's machines have no GPU, so vLLM runs there on its CPU build;
what a GPU user gets (bfloat16, CUDA kernels, GPU memory for the KV cache, members on distinct
GPUs) is checked here. Needs vLLM (``pip install ".[vllm,test]"``), the members (aliases need
their GGUF files, see the README, or give hub ids / local folders) and the local data.

Checks, one PASS/FAIL line each (exit status 1 on a failure):

1. the drafter alone on vLLM against lm-eval's ``vllm`` on the same folder and arguments:
   8 GSM8K + 8 BBH greedy responses identical, log-likelihoods within ``--tolerance``;
2. with ``--member-devices cuda:0,cuda:1`` (two GPUs): each vLLM engine allocated its memory on
   its own GPU;
3. speed and agreement: ``lm-eval-safe bench eval --engine vllm`` (BBH, 3 subtasks x 8 questions,
   3-shot, batch auto): the ensemble on vLLM / lm-eval vllm on the drafter alone, the ensemble on
   vLLM / on transformers, and how many responses the two engines share (bfloat16 near-ties may
   flip a few).

Example::

    python scripts/check_vllm_gpu.py --members gemma3-270m,smollm2-135m --data-dir ../shared/data
    python scripts/check_vllm_gpu.py --member-devices cuda:0,cuda:1   # one GPU per member
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
#: the engine this check is of, as the registry names it (its spec checks the installed vLLM
#: before anything loads)
ENGINE = "vllm"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", default="gemma3-270m,smollm2-135m", help="drafter first")
    p.add_argument("--data-dir", default=str(REPO_ROOT.parent / "shared" / "data"))
    p.add_argument("--member-devices", default=None, help="e.g. cuda:0,cuda:1")
    p.add_argument("--engine-args", "--vllm-args", default="", help="extra model_args of every vLLM engine")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--skip-speed", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from lm_eval_safe.bench.vllm_parity import compare_with_lm_eval_vllm, lm_eval_vllm_for
    from lm_eval_safe.engines import engine
    from lm_eval_safe.harness.model import SafeEnsembleLM

    engine(ENGINE).check_versions()  # one line before any engine starts

    members = [m for m in args.members.split(",") if m]
    failed = 0

    def report(ok: bool, line: str) -> None:
        nonlocal failed
        failed += int(not ok)
        print(f"{'PASS' if ok else 'FAIL'} {line}", flush=True)

    extra = f",{args.engine_args}" if args.engine_args else ""
    start = time.perf_counter()
    alone = SafeEnsembleLM.create_from_arg_string(f"members={members[0]},engine={ENGINE},batch_size=auto{extra}")
    theirs = lm_eval_vllm_for(alone.members[0])
    parity = compare_with_lm_eval_vllm(alone, theirs, Path(args.data_dir))
    report(
        not parity["different_responses"] and parity["largest_loglikelihood_gap"] < args.tolerance,
        f"{members[0]} alone on vLLM = lm-eval vllm: {parity['responses'] - len(parity['different_responses'])}"
        f"/{parity['responses']} responses, largest log-likelihood gap "
        f"{parity['largest_loglikelihood_gap']:.2e} over {parity['loglikelihoods']} ({time.perf_counter() - start:.0f} s)",
    )
    del theirs  # vLLM engines of other processes: each frees its GPU memory

    if args.member_devices:
        devices = [d for d in args.member_devices.split(",") if d]
        before = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
        lm = SafeEnsembleLM.create_from_arg_string(
            f"members={'|'.join(members)},engine={ENGINE},member_devices={'|'.join(devices)}{extra}"
        )
        after = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
        for member, device in zip(lm.members, devices, strict=True):
            index = int(device.split(":")[1])
            used = (before[index] - after[index]) / 2**30
            report(used > 0.1, f"{member.name} on {device}: {used:.1f} GiB of that GPU taken")
        del lm

    if not args.skip_speed:
        drafter = members[0]
        bench_args = [
            "--engine", ENGINE, "--members", ",".join(members), "--drafter", drafter,
            "--limit", "8", "--batch-size", "auto", "--max-gen-toks", "96",
            "--data-dir", args.data_dir, "--skip", "hf",
            "--engine-args", args.engine_args or "enforce_eager=false",
            "--json", str(REPO_ROOT / "benchmarks" / "runs" / "check_vllm_gpu.json"),
        ]  # fmt: skip
        bench = [sys.executable, "-m", "lm_eval_safe.cli", "bench", "eval"]
        subprocess.run([*bench, *bench_args], check=True)  # its own process
        import json

        result = json.loads((REPO_ROOT / "benchmarks" / "runs" / "check_vllm_gpu.json").read_text())
        ratio = result["ensemble_over_lm_eval_vllm"]
        report(ratio is not None and ratio <= 1.5, f"ensemble on vLLM / lm-eval vllm on {drafter} alone: {ratio:.2f} (goal <= 1.5)")
        hf_ratio = result[f"ensemble_{ENGINE}_over_ensemble_hf"]
        print(f"INFO ensemble on vLLM / ensemble on transformers: {hf_ratio:.2f}")
        same = result["ensemble_responses_equal_ensemble_hf"]
        print(f"INFO responses equal between the engines: {same[0]}/{same[1]}")
        for name in ("alone", "ensemble"):
            stats = result["safe_stats"][name]
            print(
                f"INFO {name} on vLLM per generated token: {stats['submitted_tokens_per_token']:.1f} ids "
                f"submitted, {stats['computed_prefill_per_token']:.2f} prefill ids computed"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
