#!/usr/bin/env python3
"""Speed benchmark of SAFE against the drafter alone and the every-token / threshold baselines.

Why it measures what it does
----------------------------
The paper's latency claim (SAFE_SPEC §10) is that SAFE "closely matches the latency of
individual models" and is far faster than ensembling every token; §6 says verifier KV-cache
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
  the verifier cache (§6: without it the ensemble is several times slower).
* E/T, acceptance and verifier positions recomputed per token (§8) explain the times: a
  method that recomputes many verifier positions per token, or ensembles often, is slow.
* Memory: the process's max RSS (``ru_maxrss``) after each method -- monotone, so it only
  shows which method first raised the peak -- plus ``torch.cuda.max_memory_allocated`` per
  method on GPU. ``tracemalloc`` does not see torch's allocations, so it is not used.
* The union vocabulary (gac only) is built once per member set: its build time is reported
  uncached and then cached on disk (first build writes, second loads), and it is built before
  timing so that no method pays for it inside the loop.

Example::

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_speed.py --prompts 2 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import json
import os
import platform
import pstats
import resource
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from lm_eval_safe.aggregate import UnionVocabulary  # noqa: E402
from lm_eval_safe.decoding import SafeDecoder, VerifierRun, valid_utf8_prefix  # noqa: E402
from lm_eval_safe.members import Member, load_member  # noqa: E402
from lm_eval_safe.options import parse_options, resolve_drafter_index  # noqa: E402
from lm_eval_safe.small_rows import small_row_linears  # noqa: E402

PROMPT_TEMPLATE = (
    "{question} Please reason step by step, and put your final answer within \\boxed{{}}."
)
DATASET_FIELDS = {"gsm8k": "question", "math500": "problem"}

# method -> SafeDecoder options (None: not a SafeDecoder method)
METHODS: dict[str, dict[str, Any] | None] = {
    "hf_generate": None,
    "drafter": {"schedule": "drafter"},
    "safe_gac": {"schedule": "safe", "aggregator": "gac"},
    "safe_unite": {"schedule": "safe", "aggregator": "unite"},
    "every": {"schedule": "every", "aggregator": "unite", "verifier_cache": True},
    "every_nocache": {"schedule": "every", "aggregator": "unite", "verifier_cache": False},
    "threshold": {"schedule": "threshold", "aggregator": "gac"},
    "safe_nocache": {"schedule": "safe", "aggregator": "unite", "verifier_cache": False},
    "safe_gac_auto": {"schedule": "safe", "aggregator": "gac", "draft_len": "auto"},
    "safe_unite_auto": {"schedule": "safe", "aggregator": "unite", "draft_len": "auto"},
    "floor": None,
}

# (numerator, denominator) pairs the project cares about
PROJECT_RATIOS = [
    ("safe_unite", "floor"),
    ("safe_gac", "floor"),
    ("safe_unite", "hf_generate"),
    ("safe_unite", "every"),
    ("every", "every_nocache"),
    ("safe_unite", "safe_nocache"),
    ("drafter", "hf_generate"),
    ("floor", "hf_generate"),
    # the same against this project's own single-member path (same speed-ups as the ensemble)
    ("safe_gac", "drafter"),
    ("safe_unite", "drafter"),
    ("safe_gac_auto", "drafter"),
    ("safe_unite_auto", "drafter"),
    ("safe_gac", "hf_generate"),
    ("safe_gac_auto", "hf_generate"),
    ("safe_unite_auto", "hf_generate"),
    ("safe_gac", "every"),
    ("safe_unite_auto", "every"),
    ("safe_gac_auto", "every"),
]


@dataclass
class Run:
    """One method on one prompt (one repeat)."""

    method: str
    prompt: int
    repeat: int
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: int = 0
    ensemble_ops: int = 0
    verifier_positions: int = 0
    generate_seconds: float | None = None  # floor only: the drafter part
    text: str = ""
    max_rss_mib: float = 0.0
    cuda_peak_mib: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def per_token(self) -> float:
        return self.seconds / max(self.tokens, 1)


# -- helpers -----------------------------------------------------------------------------
def max_rss_mib() -> float:
    """Process peak RSS in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def current_rss_mib() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss / (1024 * 1024)


def on_cuda(members: list[Member]) -> bool:
    return any(str(m.device).startswith("cuda") for m in members)


def sync_device(members: list[Member]) -> None:
    if on_cuda(members):
        torch.cuda.synchronize()


def load_prompts(data_dir: Path, dataset: str, n: int, shots: int = 0) -> list[str]:
    """``n`` prompts; with ``shots``, each starts with that many solved problems (the last ones
    of the file, never among the prompts) as ``Question: ...\nAnswer: ...`` blocks, as few-shot
    tasks do: bare prompts make instruct members stop at once and flatter every ratio."""
    path = data_dir / dataset / "test.jsonl"
    if not path.is_file():
        raise SystemExit(f"no data file {path}; pass --data-dir (folder holding {dataset}/)")
    key = DATASET_FIELDS[dataset]
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not shots:
        return [PROMPT_TEMPLATE.format(question=row[key]) for row in rows[:n]]
    answer = "answer" if dataset == "gsm8k" else "solution"
    exemplars = "".join(
        f"Question: {row[key]}\nAnswer: {row[answer]}\n\n" for row in rows[len(rows) - shots :]
    )
    return [f"{exemplars}Question: {row[key]}\nAnswer:" for row in rows[:n]]


class _NoEosModel:
    """A member's model with its EOS logits masked (``--ignore-eos``): every method then runs
    for exactly ``max_new_tokens``, so lengths match. For speed only: the texts are not answers."""

    def __init__(self, model: Any, eos_ids: frozenset[int]):
        self._model = model
        self._eos = sorted(eos_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._model(*args, **kwargs)
        out.logits[..., self._eos] = float("-inf")
        return out


def without_eos(member: Member) -> Member:
    """A copy of ``member`` that never predicts EOS (its vocabulary tables are shared)."""
    copy = dataclasses.replace(member, model=_NoEosModel(member.model, member.eos_ids))
    copy.__dict__["vocab"] = member.vocab
    copy.__dict__["eos_ids"] = member.eos_ids
    return copy


def make_decoder(
    members: list[Member], drafter_index: int, base: dict[str, Any], overrides: dict[str, Any]
) -> SafeDecoder:
    return SafeDecoder(members, drafter_index, parse_options({**base, **overrides}))


# -- the methods that are not SafeDecoder schedules ----------------------------------------
def hf_generate(member: Member, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The drafter alone through transformers ``generate`` (greedy); returns the new ids."""
    ignore_eos = isinstance(member.model, _NoEosModel)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=member.input_device)
    config = member.model.generation_config
    pad = member.tokenizer.pad_token_id
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        out = member.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if ignore_eos else None,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=sorted(member.eos_ids) or config.eos_token_id,
            pad_token_id=pad if pad is not None else member.eos_id,
        )
    return out[0, len(prompt_ids) :].tolist()


def verify_floor(
    decoder: SafeDecoder, context: str, gen_ids: list[int], max_new_tokens: int
) -> int:
    """One verifier forward per cycle over only the new verifier tokens of each window.

    Mirrors what SAFE's decoder must at least do (re-tokenize committed + drafted text and run
    each verifier over what its cache lacks) without any policy. Returns verifier positions.
    """
    opts = decoder.options
    vocab = decoder.drafter.vocab
    runs = []
    for member in decoder.verifiers:
        reserve = min(member.max_length // 2, 2 * max_new_tokens + 8)
        runs.append(VerifierRun(member, decoder.prompt_ids(member, context, reserve), True))
    for end in range(opts.draft_len, len(gen_ids) + opts.draft_len, opts.draft_len):
        start = end - opts.draft_len
        full = vocab.spell(gen_ids[: min(end, len(gen_ids))])
        text = valid_utf8_prefix(full)
        # distributions before every drafted token of the window, as a verify pass needs
        want, offset = set(), len(vocab.spell(gen_ids[:start]))
        for token in gen_ids[start:end]:
            want.add(offset)
            offset += len(vocab.text_bytes[token])
        for run in runs:
            run.sync(text, full, want)
            run.forget_before(len(run.gen_ids) - 2 * opts.draft_len - 4)
    return sum(r.recomputed for r in runs)


def run_method(
    method: str,
    decoders: dict[str, SafeDecoder],
    members: list[Member],
    context: str,
    max_new_tokens: int,
) -> Run:
    """Time one method on one prompt; the decoder for non-SafeDecoder methods gives prompts."""
    cuda = on_cuda(members)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync_device(members)
    run = Run(method, -1, -1, 0, 0.0)
    if method in ("hf_generate", "floor"):
        decoder = decoders["_base"]
        drafter = decoder.drafter
        # hf_generate is transformers as users run it; the floor gets the speed-ups SAFE has
        speedups = small_row_linears(members) if method == "floor" else contextlib.nullcontext()
        with speedups:
            start = time.perf_counter()
            ids = hf_generate(
                drafter, decoder.prompt_ids(drafter, context, max_new_tokens), max_new_tokens
            )
            sync_device(members)
            gen_end = time.perf_counter()
            run.tokens = len(ids)
            run.text = drafter.tokenizer.decode(ids, skip_special_tokens=True)
            if method == "floor":
                run.verifier_positions = verify_floor(decoder, context, ids, max_new_tokens)
                sync_device(members)
                run.generate_seconds = gen_end - start
            run.seconds = time.perf_counter() - start
    else:
        start = time.perf_counter()
        text, stats = decoders[method].generate(context, [], max_new_tokens)
        sync_device(members)
        run.seconds = time.perf_counter() - start
        run.text = text
        run.tokens = stats.generated_tokens
        run.drafted = stats.drafted_tokens
        run.accepted = stats.accepted_tokens
        run.ensemble_ops = stats.ensemble_ops
        run.verifier_positions = stats.verifier_positions
        run.extra = {
            "cycles": stats.cycles,
            "sharpened_ops": stats.sharpened_ops,
            "aligned_positions": stats.aligned_positions,
            "decoder_wall_seconds": stats.wall_seconds,
        }
    run.max_rss_mib = max_rss_mib()
    if cuda:
        run.cuda_peak_mib = torch.cuda.max_memory_allocated() / (1024 * 1024)
    return run


# -- union vocabulary ---------------------------------------------------------------------
def time_union(members: list[Member], drafter_index: int) -> dict[str, float]:
    """Token-vocabulary tables, then the union: uncached, cached (write), cached (load)."""
    ordered = [members[drafter_index]] + [m for i, m in enumerate(members) if i != drafter_index]
    out: dict[str, float] = {}
    start = time.perf_counter()
    vocabs = [m.vocab for m in ordered]  # cached_property: built here the first time
    out["token_vocab_tables_s"] = time.perf_counter() - start
    start = time.perf_counter()
    union = UnionVocabulary.build(vocabs, cache_dir=None)
    out["union_uncached_s"] = time.perf_counter() - start
    out["union_size"] = len(union)
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("union_cache_write_s", "union_cache_load_s"):
            start = time.perf_counter()
            cached = UnionVocabulary.build(vocabs, cache_dir=Path(tmp))
            out[label] = time.perf_counter() - start
            assert cached.keys == union.keys, "cached union differs from the built one"
    return out


# -- aggregation ------------------------------------------------------------------------
def summarise(runs: list[Run], methods: list[str]) -> dict[str, dict[str, Any]]:
    ref = {(r.prompt, r.repeat): r for r in runs if r.method == "hf_generate"}
    summary: dict[str, dict[str, Any]] = {}
    for method in methods:
        mine = [r for r in runs if r.method == method]
        tokens = sum(r.tokens for r in mine)
        seconds = sum(r.seconds for r in mine)
        drafted = sum(r.drafted for r in mine)
        row: dict[str, Any] = {
            "runs": len(mine),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else 0.0,
            "ms_per_token": 1000 * seconds / tokens if tokens else 0.0,
            "ensemble_rate_percent": 100 * sum(r.ensemble_ops for r in mine) / tokens
            if tokens
            else 0.0,
            "acceptance_rate": sum(r.accepted for r in mine) / drafted if drafted else None,
            "verifier_positions_per_token": sum(r.verifier_positions for r in mine) / tokens
            if tokens
            else 0.0,
            "max_rss_mib_after": max(r.max_rss_mib for r in mine) if mine else 0.0,
            "cuda_peak_mib": max((r.cuda_peak_mib or 0.0) for r in mine)
            if mine and mine[0].cuda_peak_mib is not None
            else None,
        }
        pairs = [(r, ref[(r.prompt, r.repeat)]) for r in mine if (r.prompt, r.repeat) in ref]
        if pairs:
            row["vs_hf_median"] = statistics.median(r.per_token / h.per_token for r, h in pairs)
            ref_tokens = sum(h.tokens for _, h in pairs)
            ref_seconds = sum(h.seconds for _, h in pairs)
            row["vs_hf_total"] = (seconds / max(tokens, 1)) / (ref_seconds / max(ref_tokens, 1))
            row["same_text_as_hf"] = sum(r.text == h.text for r, h in pairs) / len(pairs)
        if method == "floor":
            gen = sum(r.generate_seconds or 0.0 for r in mine)
            row["floor_generate_seconds"] = gen
            row["floor_verify_seconds"] = seconds - gen
        summary[method] = row
    return summary


def ratios(runs: list[Run], methods: list[str]) -> list[dict[str, Any]]:
    """Per-token-time ratios of two methods: median over (prompt, repeat) pairs, and totals."""
    by_key = {(r.method, r.prompt, r.repeat): r for r in runs}
    out = []
    for num, den in PROJECT_RATIOS:
        if num not in methods or den not in methods:
            continue
        per_pair = []
        for (m, p, rep), r in by_key.items():
            if m == num and (den, p, rep) in by_key:
                per_pair.append(r.per_token / by_key[(den, p, rep)].per_token)
        a = [r for r in runs if r.method == num]
        b = [r for r in runs if r.method == den]
        total = (sum(r.seconds for r in a) / max(sum(r.tokens for r in a), 1)) / (
            sum(r.seconds for r in b) / max(sum(r.tokens for r in b), 1)
        )
        out.append(
            {
                "ratio": f"{num}/{den}",
                "median": statistics.median(per_pair) if per_pair else None,
                "total": total,
                "min": min(per_pair) if per_pair else None,
                "max": max(per_pair) if per_pair else None,
            }
        )
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        f"### bench_speed: {cfg['members']} (drafter {cfg['drafter']}), {cfg['dataset']}, "
        f"{cfg['prompts']} prompt(s) x {cfg['repeats']} repeat(s), max_new_tokens="
        f"{cfg['max_new_tokens']}, draft_len={cfg['draft_len']}, device={cfg['device']}, "
        f"torch threads={cfg['torch_threads']}, shots={cfg.get('shots', 0)}, "
        f"fast_small_linear={cfg.get('fast_small_linear', 'off')}"
        + (", EOS masked (--ignore-eos)" if cfg["ignore_eos"] else ""),
        "",
        "| method | tokens | s | tok/s | t/token vs hf (median) | (total) | E/T % | acceptance "
        "| verifier pos/token | = hf text | max RSS MiB after | CUDA peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, row in report["methods"].items():
        lines.append(
            f"| {method} | {row['tokens']} | {_fmt(row['seconds'])} | "
            f"{_fmt(row['tokens_per_second'])} | {_fmt(row.get('vs_hf_median'))} | "
            f"{_fmt(row.get('vs_hf_total'))} | {_fmt(row['ensemble_rate_percent'])} | "
            f"{_fmt(row['acceptance_rate'], 3)} | {_fmt(row['verifier_positions_per_token'])} | "
            f"{_fmt(row.get('same_text_as_hf'))} | {_fmt(row['max_rss_mib_after'], 0)} | "
            f"{_fmt(row['cuda_peak_mib'], 0)} |"
        )
    if "floor" in report["methods"]:
        f = report["methods"]["floor"]
        lines += [
            "",
            f"floor = drafter generate {f['floor_generate_seconds']:.2f}s + verifier forwards "
            f"{f['floor_verify_seconds']:.2f}s",
        ]
    if report["ratios"]:
        lines += [
            "",
            "| per-token time ratio | median | total | min | max |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in report["ratios"]:
            lines.append(
                f"| {r['ratio']} | {_fmt(r['median'])} | {_fmt(r['total'])} | "
                f"{_fmt(r['min'])} | {_fmt(r['max'])} |"
            )
    short = [
        m
        for m, row in report["methods"].items()
        if row["runs"] and row["tokens"] < 0.5 * row["runs"] * cfg["max_new_tokens"]
    ]
    if short:
        lines += [
            "",
            f"WARNING: {', '.join(short)} stopped (EOS) at under half of max_new_tokens on "
            "average: per-token times of so few tokens are dominated by prefill and fixed "
            "costs. (SmolLM2-Instruct answers a plain-text prompt with <|im_end|> at once, "
            "and as a verifier it pulls the ensemble to EOS: use --ignore-eos for speed.)",
        ]
    u = report["union_vocabulary"]
    lines += [
        "",
        f"union vocabulary ({int(u['union_size'])} strings): token tables "
        f"{u['token_vocab_tables_s']:.2f}s, build uncached {u['union_uncached_s']:.2f}s, "
        f"cached first build (writes) {u['union_cache_write_s']:.2f}s, cached load "
        f"{u['union_cache_load_s']:.2f}s",
        f"member load {report['load_seconds']:.1f}s",
    ]
    return "\n".join(lines) + "\n"


# -- main -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", default="smollm2-135m,gemma3-270m")
    p.add_argument("--drafter", default=None, help="member name or index (default: first)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dataset", choices=sorted(DATASET_FIELDS), default="gsm8k")
    p.add_argument("--data-dir", type=Path, default=REPO_ROOT.parent / "shared" / "data")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--draft-len", type=int, default=5)
    p.add_argument("--shots", type=int, default=0, help="solved problems before each prompt")
    p.add_argument(
        "--fast-small-linear", default="auto", choices=("auto", "on", "off"), help="model arg of the same name"
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=0,
        help="shared-prefix store per member (default off: every method would reuse the prompt "
        "the method before it prefilled; scripts/bench_eval.py measures reuse across requests)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
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
        "--profile",
        default=None,
        metavar="METHOD",
        help="after the benchmark, cProfile METHOD on the first prompt and print the top entries",
    )
    p.add_argument("--json", type=Path, default=None, dest="json_out")
    p.add_argument("--markdown", type=Path, default=None, dest="markdown_out")
    args = p.parse_args(argv)
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if args.profile and args.profile not in METHODS:
        p.error(f"--profile {args.profile!r} is not a method")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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

    start = time.perf_counter()
    members = [
        load_member(
            spec,
            index=i,
            device=args.device,
            dtype=args.dtype,
            fast_small_linear=args.fast_small_linear,
            prefix_cache_mb=args.prefix_cache_mb,
        )
        for i, spec in enumerate(specs)
    ]
    load_seconds = time.perf_counter() - start
    if args.ignore_eos:
        members = [without_eos(m) for m in members]
    print(f"loaded {', '.join(m.name for m in members)} in {load_seconds:.1f}s", file=sys.stderr)

    union_times = time_union(members, drafter_index)
    decoders = {"_base": make_decoder(members, drafter_index, base, {})}
    for method in args.method_list:
        overrides = METHODS[method]
        if overrides is not None:
            decoders[method] = make_decoder(members, drafter_index, base, overrides)
            if (
                decoders[method].options.aggregator == "gac"
                and overrides.get("schedule") != "drafter"
            ):
                _ = decoders[method].union  # disk-cached; built outside the timed loop

    if not args.no_warmup:  # first calls pay for lazy initialisation; keep that out of timings
        for method in args.method_list:
            run_method(method, decoders, members, prompts[0], min(8, args.max_new_tokens))

    runs: list[Run] = []
    for repeat in range(args.repeats):
        for p_index, context in enumerate(prompts):
            for method in args.method_list:
                run = run_method(method, decoders, members, context, args.max_new_tokens)
                run.prompt, run.repeat = p_index, repeat
                runs.append(run)
                print(
                    f"[r{repeat} p{p_index}] {method:<14} {run.tokens:4d} tok "
                    f"{run.seconds:7.2f}s {run.tokens / max(run.seconds, 1e-9):7.2f} tok/s "
                    f"E={run.ensemble_ops} vpos={run.verifier_positions} "
                    f"rss={run.max_rss_mib:.0f}MiB",
                    file=sys.stderr,
                    flush=True,
                )

    report = {
        "config": {
            "members": ",".join(specs),
            "drafter": members[drafter_index].name,
            "dataset": args.dataset,
            "prompts": len(prompts),
            "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens,
            "draft_len": args.draft_len,
            "shots": args.shots,
            "fast_small_linear": args.fast_small_linear,
            "prefix_cache_mb": args.prefix_cache_mb,
            "methods": args.method_list,
            "device": str(members[0].device),
            "dtype": str(members[0].dtype).replace("torch.", ""),
            "torch_threads": torch.get_num_threads(),
            "ignore_eos": args.ignore_eos,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "load_seconds": load_seconds,
        "union_vocabulary": union_times,
        "methods": summarise(runs, args.method_list),
        "ratios": ratios(runs, args.method_list),
        "current_rss_mib_end": current_rss_mib(),
        "runs": [
            {k: v for k, v in vars(r).items()} | {"per_token_seconds": r.per_token} for r in runs
        ],
    }
    table = markdown(report)
    print(table)
    if args.markdown_out:
        args.markdown_out.write_text(table, encoding="utf-8")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2), encoding="utf-8")

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run_method(args.profile, decoders, members, prompts[0], args.max_new_tokens)
        profiler.disable()
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).sort_stats("cumulative").print_stats(30)
        print(f"\n### cProfile of {args.profile} (cumulative, top 30)\n", file=sys.stderr)
        print(buffer.getvalue(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
