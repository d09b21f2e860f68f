"""The llama.cpp engine's single-member path against llama-cpp-python's own generation, side by
side in one process.

Why this benchmark: a user who runs GGUF files already has llama-cpp-python; the engine is worth
its seam only if a member alone on it (``members=<one>,engine=llama_cpp`` through lm-eval's
``generate_until``, the package's whole path: requests, batching, stop checks) keeps
llama-cpp-python's speed, and, at several rows, what ``batch_rows`` buys against the default
(rows decoded apart, each row's text the one it gets alone).

For each member: greedy generation of GSM8K questions in the member's chat template (a member
without one: 3-shot prompts), ``--max-new-tokens`` at most, stopping at the member's end-of-text
ids only, timed as

- ``llama_cpp_python``: ``Llama.generate`` on the same GGUF file, the same ids, ``n_batch``,
  ``n_ctx``, threads and flash attention, repacked weight layouts off (as the engine loads
  them), one prompt after another (reusing the previous prompt's common prefix, as it does;
  each run starts from an empty cache on both sides);
- ``alone_b1``: the single-member path at ``batch_size=1`` (its texts must equal the
  reference's computed fresh for each prompt, token for token);
- ``alone_b8``: the same at ``batch_size=8`` (rows decoded apart; the same texts again);
- ``batch_rows_b8``: ``batch_rows=true`` at ``batch_size=8`` (rows in one ``llama_decode``; texts
  may differ).

The runs are interleaved over ``--repeats`` rounds (the order reversed every other round); the
median of each run's tokens per second is reported, and every ratio against
``llama_cpp_python``. The process's resident memory after loading each member is printed beside
the GGUF file's size.

Example::

    HF_HUB_OFFLINE=1 .venv/bin/lm-eval-safe bench llama-cpp --prompts 8 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from lm_eval_safe.answer_checking import MATH_PROMPT_SUFFIX
from lm_eval_safe.bench import commands
from lm_eval_safe.bench.memory import rss_mib
from lm_eval_safe.bench.output import fmt, write_json_report
from lm_eval_safe.bench.prompts import load_prompts
from lm_eval_safe.cli_options import (
    DEFAULT_MEMBERS,
    add_data_dir,
    add_members,
    local_data_dir,
    split_list,
)

RUNS = ("llama_cpp_python", "alone_b1", "alone_b8", "batch_rows_b8")


def configure(p: argparse.ArgumentParser) -> None:
    add_members(p, default=f"{DEFAULT_MEMBERS},qwen2.5-coder-0.5b")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--shots", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="n_threads (0: every core)")
    p.add_argument("--flash-attn", default="on", choices=("on", "off"))
    add_data_dir(p)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)


def reference_model(path: str, settings: dict[str, Any]) -> Any:
    """llama-cpp-python's ``Llama`` with the engine's settings (its default model parameters
    patched while it loads: ``Llama`` has no argument for the repacked layouts)."""
    import llama_cpp
    from llama_cpp import Llama

    made = llama_cpp.llama_model_default_params

    def without_repacking() -> Any:
        params = made()
        params.use_extra_bufts = settings["use_extra_bufts"]
        return params

    llama_cpp.llama.llama_cpp.llama_model_default_params = without_repacking
    try:
        return Llama(
            model_path=path,
            n_ctx=settings["n_ctx"],
            n_batch=settings["n_batch"],
            n_ubatch=settings["n_batch"],
            n_threads=settings["n_threads"],
            n_threads_batch=settings["n_threads"],
            flash_attn=settings["flash_attn"] == "on",
            swa_full=True,
            verbose=False,
        )
    finally:
        llama_cpp.llama.llama_cpp.llama_model_default_params = made


def reference_generate(
    llama: Any, prompts: list[list[int]], n: int, stop: frozenset[int], fresh: bool = False
) -> list[list[int]]:
    """Greedy tokens of each prompt; ``fresh``: nothing of the previous prompt reused."""
    out = []
    for ids in prompts:
        if fresh:
            llama.reset()
        tokens: list[int] = []
        for token in llama.generate(ids, temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if token in stop or len(tokens) == n:
                break
        out.append(tokens)
    return out


def member_prompts(lm: Any, questions: list[str], shots: list[str]) -> list[str]:
    """The contexts lm-eval hands the model: the question as a chat (rendered in the member's
    own template) where the member has one, else the few-shot prompt."""
    if lm.members[0].has_chat_template:
        return [lm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    return shots


def ours_generate(lm: Any, prompts: list[str], n: int) -> list[str]:
    from lm_eval.api.instance import Instance

    requests = [
        Instance(request_type="generate_until", doc={}, arguments=(p, {"until": [], "max_gen_toks": n}), idx=0)
        for p in prompts
    ]
    lm.members[0].engine.forget_prefixes()
    return lm.generate_until(requests, disable_tqdm=True)


def bench_member(alias: str, args: argparse.Namespace, questions: list[str], shots: list[str]) -> dict[str, Any]:
    from lm_eval_safe.decoder.loop import encoded_prompt
    from lm_eval_safe.harness.model import SafeEnsembleLM

    base = f"members={alias},engine=llama_cpp,n_threads={args.threads},flash_attn={args.flash_attn}"
    gc.collect()
    before = rss_mib()
    models = {
        "alone_b1": SafeEnsembleLM.create_from_arg_string(f"{base},batch_size=1"),
    }
    loaded = rss_mib()
    models["alone_b8"] = SafeEnsembleLM.create_from_arg_string(f"{base},batch_size=8")
    models["batch_rows_b8"] = SafeEnsembleLM.create_from_arg_string(f"{base},batch_size=8,batch_rows=true")
    member = models["alone_b1"].members[0]
    settings = {**member.engine.settings, "n_ctx": member.engine.model.n_ctx}
    llama = reference_model(member.source.location, settings)
    prompts = member_prompts(models["alone_b1"], questions, shots)
    ids = [encoded_prompt(member, p) for p in prompts]
    stop = member.eos_ids
    fresh = reference_generate(llama, ids, args.max_new_tokens, stop, fresh=True)
    fresh_texts = [member.tokenizer.decode([t for t in ts if t not in stop]) for ts in fresh]

    # warm-up: each run once on one prompt (first-use costs of torch and llama.cpp)
    reference_generate(llama, ids[:1], 8, stop)
    for lm in models.values():
        ours_generate(lm, prompts[:1], 8)
        lm.run_stats = type(lm.run_stats)()

    speeds: dict[str, list[float]] = {name: [] for name in RUNS}
    texts: dict[str, list[str]] = {}
    for round_ in range(args.repeats):
        for name in RUNS if round_ % 2 == 0 else RUNS[::-1]:
            start = time.perf_counter()
            if name == "llama_cpp_python":
                llama.reset()  # nothing of an earlier run reused (each run starts empty)
                start = time.perf_counter()
                tokens = reference_generate(llama, ids, args.max_new_tokens, stop)
                wall = time.perf_counter() - start
                count = sum(len(t) for t in tokens)
            else:
                texts[name] = ours_generate(models[name], prompts, args.max_new_tokens)
                wall = time.perf_counter() - start
                count = models[name].run_stats.generated_tokens
                models[name].run_stats = type(models[name].run_stats)()
            speeds[name].append(count / wall)
            print(f"{alias} round {round_ + 1} {name}: {count} tokens, {count / wall:.1f} tokens/s", flush=True)
    median = {name: statistics.median(v) for name, v in speeds.items()}
    for lm in models.values():
        lm.members[0].engine.model.close()
    gguf = Path(member.source.location)
    del models, llama, member
    return {
        "member": alias,
        "gguf_mib": round(gguf.stat().st_size / 2**20, 1),
        "rss_after_load_mib": round(loaded - before, 1) if loaded and before else None,
        "tokens_per_second": {k: round(v, 1) for k, v in median.items()},
        "over_llama_cpp_python": {k: round(v / median["llama_cpp_python"], 3) for k, v in median.items()},
        "texts_equal_llama_cpp_python": {
            name: [sum(a == b for a, b in zip(texts[name], fresh_texts, strict=True)), len(fresh_texts)]
            for name in RUNS[1:]
        },
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"`{report['command']}`",
        "",
        f"{report['machine']}; {report['prompts']} GSM8K questions (chat template, or {report['shots']}-shot "
        "without one), greedy, "
        f"{report['max_new_tokens']} new tokens at most; tokens/s (median of {report['repeats']} rounds) "
        "and the ratio to llama-cpp-python's own `Llama.generate`",
        "",
        "| member | llama-cpp-python | alone, batch 1 | alone, batch 8 | batch_rows, batch 8 | texts equal (b1; b8; batch_rows b8) | GGUF MiB | RSS after load MiB |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in report["members"]:
        tps, ratio, same = row["tokens_per_second"], row["over_llama_cpp_python"], row["texts_equal_llama_cpp_python"]
        cells = [f"{tps['llama_cpp_python']:.1f}"] + [f"{tps[n]:.1f} ({fmt(ratio[n])}x)" for n in RUNS[1:]]
        equal = "; ".join(f"{a}/{b}" for a, b in same.values())
        lines.append(f"| {row['member']} | {' | '.join(cells)} | {equal} | {row['gguf_mib']} | {row['rss_after_load_mib']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench llama-cpp`` with a plain argument list."""
    return commands.main("llama-cpp", argv)


def run(args: argparse.Namespace) -> int:
    import sys
    from importlib.metadata import version

    data = local_data_dir(args.data_dir, "lm-eval-safe bench llama-cpp")
    questions = [q.removesuffix(MATH_PROMPT_SUFFIX) for q in load_prompts(data, "gsm8k", args.prompts)]
    shots = load_prompts(data, "gsm8k", args.prompts, shots=args.shots)
    rows = [bench_member(alias, args, questions, shots) for alias in split_list(args.members)]
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, llama-cpp-python {version('llama-cpp-python')}",
        "prompts": args.prompts,
        "shots": args.shots,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "members": rows,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        write_json_report(Path(args.json), report, trailing_newline=True)
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    return 0

