"""The methods ``lm-eval-safe bench speed`` times, one prompt at a time.

Members are loaded once; every method then runs on the same prompt back to back (prompt 1:
A, B, C, ...; prompt 2: A, B, C, ...), so drift of the machine (other jobs, thermal state) hits
all methods alike. Decoding is greedy, with the same ``max_new_tokens`` and no stop string but
EOS. ``hf_generate`` (transformers ``generate`` of the drafter alone) is the reference a user
would otherwise run; ``floor`` is :func:`lm_eval_safe.bench.floor.verify_floor` after it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lm_eval_safe.bench.floor import verify_floor
from lm_eval_safe.bench.latency_model import ForwardLatency, modelled_seconds
from lm_eval_safe.bench.memory import max_rss_mib
from lm_eval_safe.bench.timing import on_cuda, sync_device, timed
from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.decoder.stats import BENCH_COUNTS, counts
from lm_eval_safe.engines import engines_active, instruments
from lm_eval_safe.ensemble.aggregate import UnionVocabulary
from lm_eval_safe.members.member import Member
from lm_eval_safe.options import parse_options

# method -> SafeDecoder options (None: not a SafeDecoder method)
METHODS: dict[str, dict[str, Any] | None] = {
    "hf_generate": None,
    "drafter": {"schedule": "drafter"},
    "safe_gac": {"schedule": "safe", "aggregator": "gac"},
    "safe_unite": {"schedule": "safe", "aggregator": "unite"},
    # the same with trace=true's work (each point's candidates, each response a JSON line)
    "safe_unite_traced": {"schedule": "safe", "aggregator": "unite"},
    "safe_gac_traced": {"schedule": "safe", "aggregator": "gac"},
    "every": {"schedule": "every", "aggregator": "unite", "verifier_cache": True},
    "every_nocache": {"schedule": "every", "aggregator": "unite", "verifier_cache": False},
    "threshold": {"schedule": "threshold", "aggregator": "gac"},
    "safe_nocache": {"schedule": "safe", "aggregator": "unite", "verifier_cache": False},
    "safe_gac_auto": {"schedule": "safe", "aggregator": "gac", "draft_len": "auto"},
    "safe_unite_auto": {"schedule": "safe", "aggregator": "unite", "draft_len": "auto"},
    # verifiers on threads of their own beside the next draft (overlap=on; auto is off on CPU)
    "safe_unite_overlap": {"schedule": "safe", "aggregator": "unite", "overlap": "on"},
    "safe_gac_overlap": {"schedule": "safe", "aggregator": "gac", "overlap": "on"},
    "floor": None,
}


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
    # the latency model (lm_eval_safe.bench.latency_model): seconds in turn and overlapped
    modelled_seconds: float | None = None
    modelled_overlapped_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def per_token(self) -> float:
        return self.seconds / max(self.tokens, 1)


def make_decoder(
    members: list[Member], drafter_index: int, base: dict[str, Any], overrides: dict[str, Any]
) -> SafeDecoder:
    """A decoder over loaded members with ``base`` options and one method's ``overrides``."""
    return SafeDecoder(members, drafter_index, parse_options({**base, **overrides}))


def hf_generate(member: Member, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The drafter alone through transformers ``generate`` (greedy); returns the new ids.

    With EOS masked (:func:`lm_eval_safe.bench.eos.mask_eos`) the output layer itself never
    predicts EOS, so ``generate`` runs to ``max_new_tokens`` as every other method does."""
    pad = member.tokenizer.pad_token_id
    return instruments(member).generate(member, [prompt_ids], max_new_tokens, pad if pad is not None else member.eos_id)[0]


def _run_drafter_alone(
    method: str, decoder: SafeDecoder, members: list[Member], context: str, max_new_tokens: int
) -> Run:
    """``hf_generate``, or ``floor``: the same, with SAFE's speed-ups, then the verifiers."""
    run = Run(method, -1, -1, 0, 0.0)
    drafter = decoder.drafter
    # hf_generate is transformers as users run it; the floor gets the speed-ups SAFE has
    speedups = engines_active(members) if method == "floor" else contextlib.nullcontext()
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
    return run


def _run_decoder(
    method: str,
    decoder: SafeDecoder,
    members: list[Member],
    context: str,
    max_new_tokens: int,
    latencies: list[ForwardLatency] | None = None,
) -> Run:
    """One SafeDecoder schedule, with the statistics that explain its time (``*_traced``: with
    every response's trace serialised, as ``trace=true`` writes it)."""
    job = GenerationJob(context, [], max_new_tokens)
    lines: list[str] = []
    on_trace = (lambda _i, record: lines.append(json.dumps(record))) if method.endswith("_traced") else None
    decoder.cycle_log = []
    results, seconds = timed(lambda: decoder.generate_many([job], 1, on_trace=on_trace), members)
    cycles, decoder.cycle_log = decoder.cycle_log, None
    text, stats = results[0]
    run = Run(method, -1, -1, stats.generated_tokens, seconds, text=text)
    if latencies is not None:
        run.modelled_seconds, run.modelled_overlapped_seconds = modelled_seconds(cycles, latencies)
    run.drafted = stats.drafted_tokens
    run.accepted = stats.accepted_tokens
    run.ensemble_ops = stats.ensemble_ops
    run.verifier_positions = stats.verifier_positions
    run.extra = counts(stats, BENCH_COUNTS) | {
        "decoder_wall_seconds": stats.wall_seconds,
        "verifier_forwards": sum(stats.verifier_forwards.values()),
    }
    return run


def run_method(
    method: str,
    decoders: dict[str, SafeDecoder],
    members: list[Member],
    context: str,
    max_new_tokens: int,
    latencies: list[ForwardLatency] | None = None,
) -> Run:
    """Time one method on one prompt; the decoder for non-SafeDecoder methods gives prompts.
    With ``latencies`` (the drafter's, then each verifier's) a decoder run is also priced by the
    model."""
    cuda = on_cuda(members)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync_device(members)
    if method in ("hf_generate", "floor"):
        run = _run_drafter_alone(method, decoders["_base"], members, context, max_new_tokens)
    else:
        run = _run_decoder(method, decoders[method], members, context, max_new_tokens, latencies)
    run.max_rss_mib = max_rss_mib()
    if cuda:
        run.cuda_peak_mib = torch.cuda.max_memory_allocated() / (1024 * 1024)
    return run


def time_methods(
    methods: list[str],
    decoders: dict[str, SafeDecoder],
    members: list[Member],
    prompts: list[str],
    max_new_tokens: int,
    repeats: int,
    latencies: list[ForwardLatency] | None = None,
) -> list[Run]:
    """Every method on every prompt, ``repeats`` times, methods back to back per prompt; a line
    per run on stderr."""
    runs: list[Run] = []
    for repeat in range(repeats):
        for p_index, context in enumerate(prompts):
            for method in methods:
                run = run_method(method, decoders, members, context, max_new_tokens, latencies)
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
    return runs


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
