"""Hold this package's SAFE to the authors' own code: the same real members, prompts and
settings through their ``safe_generate_unite`` / ``safe_generate_gac`` and through
``safe-ensemble`` (``reference=paper``, the default, and ``reference=authors``), side by side.

It prints, per setting and prompt, whether the texts and ensemble positions agree, and with
``--write`` records everything (the authors' ids, texts and ensemble positions, both of this
package's, the settings, the members' sha256 and the versions on both sides) as the expected
values ``tests/ensemble/authors/test_authors_conformance.py`` holds the package to.

The authors' code is never downloaded or copied here; give a folder holding it. How the record
in ``tests/data/authors_conformance.json`` was made, on the project's 2-core CPU VM:

1. ``SAFE/safe_generate_unite.py``, ``safe_generate_gac.py``, ``caching.py`` and ``logger.py`` of
   the paper's repository (revision 1c8dc8d; a copy lies under ``SAFE/`` of the public
   repository ``zeyuji/LLM-PeerReview``), unchanged, in a folder outside this repository;
2. the transformers their cache pruning needs (before 4.54) in a side folder:
   ``pip install --no-deps --target SIDE transformers==4.53.3 tokenizers==0.21.4
   huggingface_hub==0.34.4``;
3. ``lm-eval-safe bench conformance --authors-dir DIR --side-packages SIDE
   --data-dir ../shared/data --write tests/data/authors_conformance.json``
   (about an hour and a half: the authors' side recomputes the verifier's whole logits).

Both sides run the members' GGUF files in float32 on the CPU with the tokenizers this package
builds (transformers 4.53 reads these GGUF tokenizers differently, so they are handed over as
``tokenizer.json``), from the same prompt ids. What ``scripts/authors_runner.py`` changes at run
time (none of it the algorithm) is in its docstring.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

from lm_eval_safe.bench import commands
from lm_eval_safe.bench.conformance import (
    AUTHORS_SHARPEN,
    DRAFT_LEN,
    DTYPE,
    SETTINGS,
    SHARPEN_LAMBDA,
    TOP_K,
    Outcome,
    Setting,
    authors_outcome,
    conformance_prompts,
    outcome_dict,
    prompt_digest,
    run_project,
)
from lm_eval_safe.cli_options import add_data_dir, local_data_dir, repository_root
from lm_eval_safe.decoder.loop import encoded_prompt
from lm_eval_safe.engines import load_member
from lm_eval_safe.members.sources import content_identity

#: scripts/authors_runner.py, which runs in the authors' Python: the wheel carries a copy here
PACKAGED_RUNNER = Path(__file__).resolve().parents[1] / "authors_runner.py"
AUTHORS_CODE = (
    "SAFE/safe_generate_unite.py and safe_generate_gac.py of the paper's repository at revision 1c8dc8d "
    "(the copy under SAFE/ of zeyuji/LLM-PeerReview), unchanged; run-time changes: scripts/authors_runner.py"
)


def runner() -> Path:
    """The authors' side's script: the wheel's copy, or the checkout's ``scripts/``."""
    root = repository_root()
    path = PACKAGED_RUNNER if root is None else root / "scripts" / "authors_runner.py"
    if not path.is_file():
        raise SystemExit(f"lm-eval-safe bench conformance: {path} is missing: reinstall lm-eval-safe or restore it from the repository")
    return path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--authors-dir", type=Path, required=True, help="folder holding the authors' SAFE files")
    parser.add_argument("--side-packages", type=Path, required=True, help="folder holding transformers<4.54")
    add_data_dir(parser)
    parser.add_argument("--gsm8k", type=int, default=10, help="GSM8K questions (one-shot)")
    parser.add_argument("--bbh-per-task", type=int, default=2, help="questions per BBH subject (3-shot CoT)")
    parser.add_argument("--settings", default=",".join(s.name for s in SETTINGS))
    parser.add_argument("--write", type=Path, help="record everything as the tests' expected values")
    parser.add_argument("--work", type=Path, help="folder for the jobs and tokenizers (default: a temporary one)")


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """The authors' folder checked, the data folder found."""
    for needed in ("safe_generate_unite.py", "safe_generate_gac.py", "caching.py", "logger.py"):
        if not (args.authors_dir / needed).is_file():
            raise SystemExit(f"--authors-dir {args.authors_dir} lacks {needed}: give the folder of the authors' SAFE files")
    args.data_dir = local_data_dir(args.data_dir, "lm-eval-safe bench conformance")
    return args


def tokenizer_spec(member: Any, folder: Path) -> dict[str, Any]:
    """What the authors' side needs to load a member: its GGUF file and this package's tokenizer."""
    tokenizer = member.tokenizer
    path = folder / f"{member.name}.tokenizer.json"
    tokenizer.backend_tokenizer.save(str(path))
    return {
        "gguf": member.source.location,
        "tokenizer_file": str(path),
        "clean_up_tokenization_spaces": bool(tokenizer.clean_up_tokenization_spaces),
        "special_tokens": {
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "unk_token": tokenizer.unk_token,
            "pad_token": tokenizer.pad_token,
        },
    }


def run_authors(args: argparse.Namespace, setting: Setting, members: list[Any], prompts: list[tuple[str, str]], work: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The authors' code on every prompt, in a Python whose path starts with their folder and
    the side packages: its versions, then one record per prompt."""
    job = {
        "members": [tokenizer_spec(m, work) for m in members],
        "cases": [
            {"id": case, "drafter_prompt": encoded_prompt(members[0], p), "verifier_prompt": encoded_prompt(members[1], p)}
            for case, p in prompts
        ],
        "max_new_tokens": setting.max_new_tokens,
        "gamma": DRAFT_LEN,
        "aggregator": setting.aggregator,
        "sharpen_type": AUTHORS_SHARPEN[setting.sharpen],
    }
    job_path, output = work / f"{setting.name}.job.json", work / f"{setting.name}.authors.jsonl"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    path = os.pathsep.join(str(p.resolve()) for p in (args.side_packages, args.authors_dir))
    env = {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, str(runner()), str(job_path), str(output)], check=True, env=env, cwd=work)
    versions, *records = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    return versions, records


def compare_setting(args: argparse.Namespace, setting: Setting, members: list[Any], work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """One setting on every prompt: the authors', ``reference=paper``'s and ``reference=authors``'."""
    prompts = conformance_prompts(args.data_dir, args.gsm8k, args.bbh_per_task)
    versions, records = run_authors(args, setting, members, prompts, work)
    texts = [p for _, p in prompts]
    ours = {reference: run_project(members, setting, reference, texts) for reference in ("paper", "authors")}
    drafter = members[0]
    cases = []
    for index, ((case, prompt), record) in enumerate(zip(prompts, records, strict=True)):
        theirs = authors_outcome(drafter.tokenizer, drafter.eos_id, record["ids"], record["points"], setting.max_new_tokens)
        cases.append(case_record(case, prompt, theirs, {r: outs[index] for r, outs in ours.items()}))
    return versions, {**vars(setting), "members": list(setting.members), "cases": cases}


def case_record(case: str, prompt: str, theirs: Outcome, ours: dict[str, Outcome]) -> dict[str, Any]:
    """The authors' code's outcome and each ``reference``'s (``reference_paper``, ``reference_authors``)."""
    record = {"id": case, "prompt_sha256": prompt_digest(prompt), "authors_code": outcome_dict(theirs)}
    for reference, outcome in ours.items():
        record[f"reference_{reference}"] = {**outcome_dict(outcome), "same_as_authors_code": outcome.same_as(theirs)}
    mark = {r: "same" if o.same_as(theirs) else "DIFF" for r, o in ours.items()}
    print(f"  {case:34s} paper {mark['paper']:4s}  authors {mark['authors']:4s}  points {theirs.points}", flush=True)
    for reference, outcome in ours.items():
        if not outcome.same_as(theirs):
            print(f"    theirs: {theirs.text[:100]!r}\n    {reference:6s}: {outcome.text[:100]!r} points {outcome.points}")
    return record


def summary(settings: list[dict[str, Any]]) -> None:
    print("\n| setting | prompts | reference=paper same | reference=authors same |")
    print("|---|---:|---:|---:|")
    for s in settings:
        n = len(s["cases"])
        same = {r: sum(c[f"reference_{r}"]["same_as_authors_code"] for c in s["cases"]) for r in ("paper", "authors")}
        print(f"| {s['name']} | {n} | {same['paper']}/{n} | {same['authors']}/{n} |")


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench conformance`` with a plain argument list."""
    return commands.main("conformance", argv)


def run(args: argparse.Namespace) -> int:
    args = finish_args(args)
    chosen = [s for s in SETTINGS if s.name in args.settings.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="safe-conformance-"))
    work.mkdir(parents=True, exist_ok=True)
    loaded: dict[tuple[str, str], list[Any]] = {}
    results, identities = [], {}
    for setting in chosen:
        if setting.members not in loaded:
            loaded = {setting.members: [load_member(n, dtype="float32", index=i) for i, n in enumerate(setting.members)]}
        members = loaded[setting.members]
        identities.update({m.name: content_identity(m.source) for m in members})
        print(f"{setting.name}: {' + '.join(setting.members)}", flush=True)
        authors_versions, record = compare_setting(args, setting, members, work)
        results.append(record)
        if args.write:  # after every setting: an hour's work is not lost to a later failure
            write_record(args, identities, authors_versions, results)
    summary(results)
    return 0


def write_record(args: argparse.Namespace, identities: dict[str, Any], authors_versions: dict[str, Any], results: list[dict[str, Any]]) -> None:
    shared = {
        "draft_len": DRAFT_LEN, "gsm8k": args.gsm8k, "bbh_per_task": args.bbh_per_task, "top_k": TOP_K,
        "sharpen_lambda": SHARPEN_LAMBDA, "gamma": DRAFT_LEN, "dtype": DTYPE, "device": "cpu",
        "chat_template": False, "until": [], "use_cache": True,
    }  # fmt: skip
    versions = {"authors_side": authors_versions, "project_side": {"transformers": transformers.__version__, "torch": torch.__version__}}
    record = {
        "made_by": "lm-eval-safe bench conformance (its docstring says how)",
        "authors_code": AUTHORS_CODE, "shared": shared, "members": identities, "versions": versions, "settings": results,
    }  # fmt: skip
    args.write.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.write}", flush=True)

