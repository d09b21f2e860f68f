#!/usr/bin/env python3
"""One part of ``scripts/check_gpu.sh`` (the GPU evidence of this package in one prepared run),
or the merge of the parts' JSON files into one report.

Why one process per part: the shell script gives each its own time limit, so a hang or a crash
loses that part only, and each part starts with the device's memory empty. The parts
(:mod:`lm_eval_safe.bench.gpu_check`, :mod:`lm_eval_safe.bench.gpu_speed`):

* ``parity``: a Llama model of about 1B parameters alone through SAFE's decoder equals
  transformers' greedy ``generate`` (float32 and bfloat16), batch 8 equals batch 1;
* ``theorem1``: two members with different tokenizers, UniTE without sharpening:
  ``schedule=safe`` writes what ``schedule=aligned`` writes, with fewer ensemble operations;
* ``speed``: an 8B drafter with a 1.7B verifier, then with its own perturbed copy: SAFE's time
  per token against ``generate`` of the drafter alone, batch 1 and 8, overlap off and on;
* ``lm_eval``: lm-eval's command line on 8 GSM8K questions with two random-weight members.

``--dry-run`` runs the same code on a CPU with shapes a few dozen dimensions wide.

Example (what check_gpu.sh runs)::

    python scripts/check_gpu.py parity --json /tmp/parity.json --dry-run
    python scripts/check_gpu.py merge --parts-dir /tmp/parts --json check_gpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PARTS = ("parity", "theorem1", "speed", "lm_eval")
REPO_ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("check_gpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=(*PARTS, "merge", "prepare"))
    p.add_argument("--json", type=Path, required=True, dest="json_out", help="where the part's JSON goes")
    p.add_argument("--dry-run", action="store_true", help="small shapes on the CPU")
    p.add_argument("--quick", action="store_true", help="with --dry-run: float32 only (bfloat16 is slow on a CPU)")
    p.add_argument("--tokenizers", type=Path, default=REPO_ROOT / ".gpu_check" / "tokenizers")
    p.add_argument("--data-dir", type=Path, default=REPO_ROOT / ".gpu_check" / "data")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 32 on a GPU, 8 dry")
    p.add_argument("--perturbation", type=float, default=0.05, help="speed: the twin's output-layer noise / RMS")
    p.add_argument("--dtypes", default="float32,bfloat16", help="parity and theorem1: the dtypes, float32 first if any")
    p.add_argument("--warm-up", type=float, default=None, help="speed: seconds of generate first (default: 30 on a GPU, 0 dry)")
    p.add_argument("--timeout", type=float, default=300, help="lm_eval: its command's limit (s)")
    p.add_argument("--parts-dir", type=Path, default=None, help="merge: the parts' JSON files")
    p.add_argument("--source-data", type=Path, default=REPO_ROOT.parent / "shared" / "data", help="prepare: the full data")
    return p.parse_args(argv)


def environment() -> dict[str, Any]:
    """What the figures ran on."""
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def run_part(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lm_eval_safe.bench.gpu_check import Settings, lm_eval_end_to_end, parity, theorem1
    from lm_eval_safe.bench.gpu_speed import speed

    if args.quick and not args.dry_run:
        raise SystemExit("check_gpu: --quick is a form of --dry-run")
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("check_gpu: no CUDA device here; run with --dry-run on a CPU")
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not names or not set(names) <= {"float32", "bfloat16"}:
        raise SystemExit(f"check_gpu: --dtypes {args.dtypes!r}: float32 and/or bfloat16")
    dtypes = tuple(getattr(torch, name) for name in names)
    if args.prompts < 8:
        raise SystemExit(f"check_gpu: --prompts {args.prompts}: batch 8 needs at least 8")
    settings = Settings(
        scale="dry" if args.dry_run else "gpu",
        device="cpu" if args.dry_run else "cuda",
        tokenizers=args.tokenizers,
        data_dir=args.data_dir,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens or (8 if args.dry_run else 32),
        dtypes=(torch.float32,) if args.quick else dtypes,
    )
    if args.dry_run:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.part == "parity":
        return parity(settings)
    if args.part == "theorem1":
        return theorem1(settings)
    if args.part == "speed":
        warm_up = args.warm_up if args.warm_up is not None else (0.0 if args.dry_run else 30.0)
        return speed(settings, args.perturbation, lambda result: write(args.json_out, result), warm_up)
    with tempfile.TemporaryDirectory(prefix="check_gpu_") as tmp:
        return lm_eval_end_to_end(settings, Path(tmp), args.timeout)


def write(path: Path, result: dict[str, Any]) -> None:
    """A part's JSON, replaced whole (a reader never sees half a file)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    partial.replace(path)


def merge(parts_dir: Path) -> dict[str, Any]:
    """The parts' JSON files and the shell's status lines (``<part>.status``: exit status and
    seconds) as one report; a part that wrote nothing gets its status and a null result."""
    report: dict[str, Any] = {}
    for part in PARTS:
        status_file = parts_dir / f"{part}.status"
        if not status_file.is_file():
            continue  # not asked for (--only)
        code, seconds = status_file.read_text().split()
        result_file = parts_dir / f"{part}.json"
        result = json.loads(result_file.read_text()) if result_file.is_file() else None
        status = {"0": "ran", "124": "timeout", "137": "timeout"}.get(code, f"exit {code}")
        entry = {"status": status, "seconds": int(seconds), "passed": bool(result and result.get("passed"))}
        report[part] = entry | {"result": result}
    for name in ("environment", "commit", "dry_run"):
        path = parts_dir / f"{name}.json"
        if path.is_file():
            report[name] = json.loads(path.read_text())
    return report


def prepare(tokenizers: Path, data_dir: Path, source_data: Path, rows: int) -> dict[str, Any]:
    """What travels to the GPU machine beside the wheels: the tokenizers of two GGUF members
    (``a``: Qwen2.5's, ``b``: SmolLM2's; transformers reads them out of the GGUF files) and
    the first ``rows`` GSM8K questions of the local data."""
    from transformers import AutoTokenizer

    from lm_eval_safe.members.aliases import resolve_alias

    source = source_data / "gsm8k" / "test.jsonl"
    if not source.is_file():
        raise SystemExit(f"check_gpu prepare: no {source}; pass --source-data (the folder holding gsm8k/)")
    (data_dir / "gsm8k").mkdir(parents=True, exist_ok=True)
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)[:rows]
    (data_dir / "gsm8k" / "test.jsonl").write_text("".join(lines), encoding="utf-8")
    made = {"data": str(data_dir / "gsm8k" / "test.jsonl"), "rows": len(lines)}
    for role, alias in (("a", "qwen2.5-coder-0.5b"), ("b", "smollm2-135m")):
        gguf = Path(resolve_alias(alias, None))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(tokenizers / role)
        made[role] = f"{alias}: {len(tokenizer)} ids"
        logger.info("tokenizer %s: %s", role, made[role])
    return made


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.part == "prepare":
        made = prepare(args.tokenizers, args.data_dir, args.source_data, 2 * args.prompts)
        args.json_out.write_text(json.dumps(made, indent=2) + "\n", encoding="utf-8")
        return 0
    if args.part == "merge":
        if args.parts_dir is None or not args.parts_dir.is_dir():
            raise SystemExit("check_gpu merge: --parts-dir must be the folder of the parts' files")
        report = merge(args.parts_dir)
        args.json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        failed = [part for part in PARTS if part in report and not report[part]["passed"]]
        print(f"check_gpu: {'FAILED ' + ','.join(failed) if failed else 'all parts passed'}: {args.json_out}")
        return 1 if failed else 0
    (args.json_out.parent / "environment.json").write_text(json.dumps(environment()))  # each part: any may run alone
    result = run_part(args)
    write(args.json_out, result)
    logger.info("%s: %s", args.part, "passed" if result.get("passed") else "FAILED")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
