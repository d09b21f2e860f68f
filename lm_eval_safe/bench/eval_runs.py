"""What ``lm-eval-safe bench eval``'s timed runs share: empty prefix stores before each run, every
run's wall times and last results, and the ensemble's floor (the drafter's own run plus each
verifier alone reading the ensemble's texts; :mod:`lm_eval_safe.bench.commands.eval` says why)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from lm_eval_safe.bench.eval_report import responses

#: the verifiers' part of the floor, timed right after the ensemble's run whose texts it reads
VERIFIER_READS = "verifier_reads"


def reset_stores(lm: Any) -> None:
    """Empty every prefix cache (this package's stores, vLLM's), so that no run inherits the
    prompts an earlier run computed, and start the run's statistics afresh."""
    from lm_eval_safe.decoder.stats import GenerationStats

    for member in lm.members:
        member.engine.forget_prefixes()
    lm._prefill_counted = [member.engine.prefill_counts() for member in lm.members]
    lm.run_stats = GenerationStats()


@dataclass
class Rounds:
    """Every timed run's wall times, and the last round's results and statistics per run."""

    runs: dict[str, list[float]]
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the last round's verifier reads, per verifier and batch size (:func:`read_answers`)
    reads: dict[str, dict[str, float]] = field(default_factory=dict)

    def median(self, name: str) -> float | None:
        return statistics.median(self.runs[name]) if self.runs.get(name) else None

    def ratio(self, a: str, b: str) -> float | None:
        x, y = self.median(a), self.median(b)
        return x / y if x is not None and y else None

    def same(self, a: str, b: str) -> list[int] | None:
        if a not in self.outputs or b not in self.outputs:
            return None
        mine, theirs = responses(self.outputs[a]), responses(self.outputs[b])
        return [sum(mine[k] == theirs.get(k) for k in mine), len(mine)]


def record_answers(lm: Any, into: list[tuple[str, str]]) -> None:
    """Keep every (context, response) ``lm`` answers (``simple_evaluate`` calls the model's
    ``generate_until`` by name, so the instance's own attribute is the one it calls); each
    call's answers replace the previous call's."""
    answer = lm.generate_until

    def generate_until(requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        texts = answer(requests, disable_tqdm)
        into[:] = [(str(r.args[0]), text) for r, text in zip(requests, texts, strict=True)]
        return texts

    lm.generate_until = generate_until


def read_answers(verifiers: Iterable[Any], answers: list[tuple[str, str]]) -> dict[str, dict[str, float]]:
    """Each verifier alone reads the ensemble's last answers: one ``loglikelihood`` request per
    answer, from an empty prefix store, at the batch size it was loaded with and at 1; the
    seconds of each verifier at each.

    Why both: the least a verifier's reads cost depends on the engine. Contexts scored in one
    batch are prefilled together (none starts from another's exemplars), one at a time each
    starts from the exemplars the one before stored; which is cheaper differs by engine and
    task, and the floor takes the lesser."""
    from lm_eval.api.instance import Instance

    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=0) for pair in answers
    ]
    seconds: dict[str, dict[str, float]] = {}
    for lm in verifiers:
        loaded = lm.options
        seconds[lm.members[0].name] = {}
        for batch_size in dict.fromkeys((loaded.batch_size, 1)):
            lm.options = replace(loaded, batch_size=batch_size)
            reset_stores(lm)
            start = time.perf_counter()
            try:
                lm.loglikelihood(requests, disable_tqdm=True)
            finally:
                lm.options = loaded
            seconds[lm.members[0].name][str(batch_size)] = time.perf_counter() - start
    return seconds


def least_reads(seconds: dict[str, dict[str, float]]) -> float:
    """The floor's reads: each verifier at its cheaper batch size, all verifiers together."""
    return sum(min(by_batch.values()) for by_batch in seconds.values())


def floor(rounds: Rounds, own_backend: str) -> dict[str, Any] | None:
    """The ensemble's floor (the module's docstring): the drafter's fastest run per generated
    token times the ensemble's tokens, plus the verifiers' reads of the ensemble's texts.

    lm-eval's own backend counts as a drafter run only where its responses equal
    safe-ensemble's alone, whose statistics hold the tokens both generated."""
    if not rounds.runs.get(VERIFIER_READS) or "ensemble" not in rounds.stats or "alone" not in rounds.stats:
        return None
    alone_tokens = rounds.stats["alone"]["generated_tokens"]
    candidates = ["alone"]
    equal = rounds.same(own_backend, "alone")
    if equal is not None and equal[0] == equal[1]:
        candidates.append(own_backend)
    per_token = {name: rounds.median(name) / alone_tokens for name in candidates}
    drafter_run = min(per_token, key=per_token.__getitem__)
    tokens = rounds.stats["ensemble"]["generated_tokens"]
    drafter_seconds = per_token[drafter_run] * tokens
    reads = rounds.median(VERIFIER_READS)
    total = drafter_seconds + reads
    return {
        "drafter_run": drafter_run,
        "drafter_seconds_per_token": per_token[drafter_run],
        "ensemble_tokens": tokens,
        "drafter_seconds": drafter_seconds,
        "verifier_reads_seconds": reads,
        "verifier_reads_by_batch_size": rounds.reads,
        "floor_seconds": total,
        "ensemble_over_floor": rounds.median("ensemble") / total,
    }
