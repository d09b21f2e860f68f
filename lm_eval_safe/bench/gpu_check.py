"""The correctness parts of ``scripts/check_gpu.sh``: parity with transformers' ``generate``
and Theorem 1, on the device the check runs on (each returns its part of the JSON).

Why on a GPU at all: every exactness test of this project runs on a CPU in float32, while users
decode on GPUs in bfloat16 with other kernels (SDPA's flash and memory-efficient attention, cuBLAS
picking algorithms by shape), and the transformers engine runs its own KV cache and batch
layout. What holds here holds where users run; where bfloat16 differs from ``generate``, each
difference comes with the reference's own margin between its two best ids at that token, so a
near-tie is told from a bug.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm_eval_safe.bench.eos import mask_eos
from lm_eval_safe.bench.gpu_members import (
    SHAPES,
    as_member,
    build_model,
    favour_ids,
    load_tokenizers,
    logit_bonus,
    parameter_count,
    word_ids,
)
from lm_eval_safe.bench.prompts import load_prompts
from lm_eval_safe.bench.speed import hf_generate
from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.decoder.stats import GenerationStats
from lm_eval_safe.engines import instruments
from lm_eval_safe.members.member import Member
from lm_eval_safe.options import parse_options

logger = logging.getLogger("check_gpu")

#: common words: Theorem 1's members favour those their tokenizers spell as one token
SHARED_WORDS = ["the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "was", "on", "he", "with", "as"]


@dataclass
class Settings:
    """What every part reads: the scale of its shapes, where, and its inputs."""

    scale: str  # "gpu" or "dry"
    device: str
    tokenizers: Path
    data_dir: Path
    prompts: int = 8
    max_new_tokens: int = 32
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)  # parity's and Theorem 1's

    def jobs(self, n: int | None = None, max_new_tokens: int | None = None) -> list[GenerationJob]:
        """Greedy jobs over the first GSM8K questions (the paper's math prompt)."""
        prompts = load_prompts(self.data_dir, "gsm8k", n or self.prompts)
        return [GenerationJob(p, [], max_new_tokens or self.max_new_tokens) for p in prompts]


def total_stats(results: list[tuple[str, GenerationStats]]) -> GenerationStats:
    total = GenerationStats()
    for _, stats in results:
        total.add(stats)
    return total


def reference_ids(decoder: SafeDecoder, member: Member, job: GenerationJob) -> tuple[list[int], list[int]]:
    """The prompt ids the decoder feeds ``member`` and transformers' greedy ids after them."""
    prompt = decoder.prompt_ids(member, job.context, job.max_new_tokens)
    return prompt, hf_generate(member, prompt, job.max_new_tokens)


def top2_margin(member: Member, ids: list[int]) -> float:
    """The gap between the two largest logits after ``ids`` (the reference's own forward)."""
    logits = instruments(member).prompt_logits(member, ids)[-1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def divergence(member: Member, prompt: list[int], ids: list[int], text: str) -> dict[str, Any]:
    """Where ``text`` leaves the reference ``ids``: the first reference token whose decoded
    prefix ``text`` does not start with, and the reference's top-2 logit margin there."""
    decode = member.tokenizer.decode
    for k in range(len(ids)):
        if not text.startswith(decode(ids[: k + 1], skip_special_tokens=True)):
            return {"token": k, "margin": round(top2_margin(member, prompt + ids[:k]), 4)}
    return {"token": len(ids), "margin": None}  # the reference is a prefix of the text


def compare_with_generate(decoder: SafeDecoder, member: Member, jobs: list[GenerationJob]) -> dict[str, Any]:
    """The single-member path at batch 1 and batch 8 against ``generate`` at batch 1."""
    references = [reference_ids(decoder, member, job) for job in jobs]
    texts = [member.tokenizer.decode(ids, skip_special_tokens=True) for _, ids in references]
    start = time.perf_counter()
    batch1 = [text for text, _ in decoder.generate_many(jobs, 1)]
    batch8 = [text for text, _ in decoder.generate_many(jobs, 8)]
    different = [
        {"prompt": i, **divergence(member, *references[i], batch1[i])}
        for i in range(len(jobs))
        if batch1[i] != texts[i]
    ]
    generated = [ids for _, ids in references]
    return {
        "prompts": len(jobs),
        "new_tokens": jobs[0].max_new_tokens,
        "equal_to_generate": sum(a == b for a, b in zip(batch1, texts, strict=True)),
        "batch8_equal_to_batch1": sum(a == b for a, b in zip(batch8, batch1, strict=True)),
        "batch8_equal_to_generate": sum(a == b for a, b in zip(batch8, texts, strict=True)),
        "differences_from_generate": different,
        "distinct_ids_generated": len({t for ids in generated for t in ids}),
        "tokens_generated": sum(len(ids) for ids in generated),
        "safe_seconds": round(time.perf_counter() - start, 2),
    }


def parity(settings: Settings) -> dict[str, Any]:
    """One Llama model of about 1B parameters alone through SAFE's decoder, against transformers'
    greedy ``generate`` on the same model object: float32 (batch 1 and batch 8 asserted), then the
    same weights in bfloat16 (batch 1 asserted, batch 8 against batch 1 measured)."""
    tokenizer = load_tokenizers(settings.tokenizers)["b"]
    model = build_model(tokenizer, SHAPES["parity"][settings.scale], 0, settings.device, torch.float32)
    out: dict[str, Any] = {"parameters": parameter_count(model), "tokenizer": tokenizer.name_or_path}
    jobs = settings.jobs()
    hooked = False
    for dtype in settings.dtypes:
        model.to(dtype)
        member = as_member(model, tokenizer, f"llama-1b-{str(dtype)[6:]}")
        if not hooked:  # the output layer is the same module in both dtypes: one hook
            mask_eos([member])
            hooked = True
        decoder = SafeDecoder([member], 0, parse_options({"members": [member.name]}))
        out[str(dtype)[6:]] = result = compare_with_generate(decoder, member, jobs)
        logger.info("parity %s: %s", dtype, {k: v for k, v in result.items() if k != "differences_from_generate"})
    fp32, bf16 = out.get("float32"), out.get("bfloat16")
    out["passed"] = (fp32 is None or fp32["equal_to_generate"] == fp32["batch8_equal_to_batch1"] == fp32["prompts"]) and (
        bf16 is None or bf16["equal_to_generate"] == bf16["prompts"]
    )
    return out


def theorem1_members(settings: Settings, dtype: torch.dtype) -> tuple[list[Member], dict[str, Any]]:
    """Two members with different tokenizers that agree at some positions and not at others:
    each favours the common words both tokenizers spell as one token, by about the margin that
    makes one of them its choice at most positions (which of them still differs by member)."""
    tokenizers = load_tokenizers(settings.tokenizers)
    shape = SHAPES["theorem1"][settings.scale]
    members = [
        as_member(build_model(tokenizers[role], shape, 1 + index, settings.device, dtype), tokenizers[role], f"theorem1-{role}", index)
        for index, role in enumerate(("a", "b"))
    ]
    spelled = [word_ids(member, SHARED_WORDS) for member in members]
    shared = [w for w in SHARED_WORDS if all(w in ids for ids in spelled)][:3]  # few: they often agree
    probe = settings.jobs(1)[0].context
    info: dict[str, Any] = {"shared_words": shared}
    for member, ids in zip(members, spelled, strict=True):
        favoured = [ids[w] for w in shared]
        bonus = logit_bonus(member, favoured, probe) if favoured else 0.0
        if favoured:
            favour_ids(member, favoured, bonus)
        mask_eos([member])
        info[member.name] = {
            "parameters": instruments(member).parameter_count(member),
            "tokenizer": member.tokenizer.name_or_path,
            "bonus": round(bonus, 3),
        }
    return members, info


def theorem1(settings: Settings) -> dict[str, Any]:
    """Theorem 1 of the paper: with UniTE's plain average (no sharpening), skipping where the
    members agree never changes the output, so ``schedule=safe`` writes exactly what
    ``schedule=aligned`` (ensembling at every aligned position) writes, with fewer ensemble
    operations. Asserted in float32, batch 1 and 8; bfloat16 measured: the two schedules
    skip different positions, so their drafts, rollbacks and verifier windows (the shapes of
    their forwards) differ, and bfloat16's rounding then differs too (on an H200 two or three of
    eight random-weight texts parted at a near-tie; float32 kept all eight equal)."""
    out: dict[str, Any] = {}
    # twice the tokens in a dry run: its tiny members need them to meet consensus at all
    jobs = settings.jobs(max_new_tokens=settings.max_new_tokens * (2 if settings.scale == "dry" else 1))
    passed = True
    for dtype in settings.dtypes:
        members, info = theorem1_members(settings, dtype)
        names = [m.name for m in members]
        runs: dict[str, Any] = {"members": info}
        for batch in (1, 8):
            texts, stats = {}, {}
            for schedule in ("safe", "aligned"):
                options = parse_options({"members": names, "schedule": schedule, "aggregator": "unite", "sharpen": "none"})
                results = SafeDecoder(members, 0, options).generate_many(jobs, batch)
                texts[schedule] = [text for text, _ in results]
                stats[schedule] = total_stats(results)
            equal = sum(a == b for a, b in zip(texts["safe"], texts["aligned"], strict=True))
            safe, aligned = stats["safe"], stats["aligned"]
            runs[f"batch{batch}"] = {
                "prompts": len(jobs),
                "equal": equal,
                "generated_tokens": safe.generated_tokens,
                "ensemble_ops_safe": safe.ensemble_ops,
                "ensemble_ops_aligned": aligned.ensemble_ops,
                "consensus_skips_safe": safe.consensus_skips,
                "aligned_positions": safe.aligned_positions,
                "ensemble_rate_percent_safe": round(safe.ensemble_rate, 2),
                "ensemble_rate_percent_aligned": round(aligned.ensemble_rate, 2),
            }
            logger.info("theorem1 %s batch %d: %s", dtype, batch, runs[f"batch{batch}"])
            if dtype == torch.float32:
                passed &= equal == len(jobs) and 0 < safe.ensemble_ops < aligned.ensemble_ops
        out[str(dtype)[6:]] = runs
        del members
    out["passed"] = passed and "float32" in out
    return out


def find_key(tree: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in a JSON tree (lm-eval moved ``config`` between
    releases), or None."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for value in tree:
            found = find_key(value, key)
            if found is not None:
                return found
    return None


def lm_eval_end_to_end(settings: Settings, work_dir: Path, timeout: float) -> dict[str, Any]:
    """lm-eval's own command line (``lm_eval_safe.cli``: lm-eval's ``cli_evaluate`` with the
    model registered, for an environment whose site-packages has not got the start-up hook) on
    ``safe_gsm8k`` over the local data: two random-weight members with different tokenizers,
    saved as folders as a user's checkpoints are, at batch 8."""
    import json
    import subprocess
    import sys

    import lm_eval_safe

    tokenizers = load_tokenizers(settings.tokenizers)
    shape = SHAPES["lm_eval"][settings.scale]
    folders = []
    for index, role in enumerate(("a", "b")):
        model = build_model(tokenizers[role], shape, 20 + index, settings.device, torch.float32)
        folder = work_dir / f"member-{role}"
        model.save_pretrained(folder)
        tokenizers[role].save_pretrained(folder)
        folders.append(str(folder))
        del model
    output = work_dir / "results"
    command = [
        sys.executable, "-m", "lm_eval_safe.cli", "--model", "safe-ensemble",
        "--model_args", f"members={','.join(folders)}",
        "--device", settings.device, "--batch_size", "8",
        "--tasks", "safe_gsm8k", "--include_path", lm_eval_safe.task_dir(),
        "--metadata", json.dumps({"data_dir": str(settings.data_dir)}),
        "--limit", str(settings.prompts), "--gen_kwargs", f"max_gen_toks={settings.max_new_tokens}",
        "--log_samples", "--output_path", str(output),
    ]  # fmt: skip
    logger.info("lm_eval: %s", " ".join(command))
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    seconds = round(time.perf_counter() - start, 1)
    logger.info("lm_eval stderr (end):\n%s", proc.stderr[-4000:])
    out: dict[str, Any] = {"returncode": proc.returncode, "seconds": seconds, "table": proc.stdout[-2000:]}
    results = sorted(output.rglob("results_*.json"))
    samples = sorted(output.rglob("samples_safe_gsm8k_*.jsonl"))
    if results:
        data = json.loads(results[-1].read_text())
        out["safe_stats"] = find_key(data, "safe_stats")
        out["exact_match"] = find_key(data.get("results", {}), "exact_match,none")
    if samples:
        out["documents"] = len(samples[-1].read_text().splitlines())
    out["passed"] = proc.returncode == 0 and bool(out.get("safe_stats")) and out.get("documents") == settings.prompts
    return out
