"""Run statistics (docs/algorithm.md, Statistics): what a user needs to judge speed and how often we ensembled."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class GenerationStats:
    requests: int = 0  # requests decoded (not those lm-eval's --use_cache answered)
    generated_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    ensemble_ops: int = 0
    ensemble_kept: int = 0  # ensemble points that kept the drafter's token (sampling: accepted)
    ensemble_replaced: int = 0  # ... that replaced it (sampling: rejected and resampled)
    aligned_positions: int = 0
    consensus_skips: int = 0  # aligned positions skipped because the members agree (SAFE)
    cycles: int = 0
    verifier_positions: int = (
        0  # verifier tokens run through a forward pass (recomputation included)
    )
    sharpened_ops: int = 0
    misaligned_ensembles: int = 0  # every/threshold baselines: ensembles at OOV-like positions
    sampled_requests: int = 0  # requests decoded by sampling (the rest are greedy)
    stopped_requests: int = 0  # requests that ended at EOS or a stop string (the rest: budget)
    # prompt tokens of every member (generation and scoring contexts; vLLM: every id submitted,
    # a resumable request's chunk included)
    prefill_tokens: int = 0
    prefill_tokens_saved: int = 0  # of those, states taken from the shared-prefix store
    # engines answering with heads (top-K log-probs: vLLM): decisions settled from the heads
    # alone, and those that asked for the full distributions (lm_eval_safe.ensemble.certified)
    certified_decisions: int = 0
    full_decisions: int = 0
    # forwards, the counts a GPU's latency follows (lm_eval_safe.decoder.latency)
    drafter_forwards: int = 0  # every drafter forward, drafted-ahead ones never used included
    verifier_forwards: dict[str, int] = field(default_factory=dict)  # per verifier member
    forward_depth: float = 0.0  # forwards one after another, verifiers after each draft
    forward_depth_overlapped: float = 0.0  # modelled, verifiers beside the next draft
    # batched engine calls (one per member per batch step, all rows together) and the wall time
    # inside them: wall minus that is this package's own host work (run-wide, not per request)
    engine_calls: int = 0
    engine_seconds: float = 0.0
    engine_seconds_by_member: dict[str, float] = field(default_factory=dict)  # where it went
    wall_seconds: float = 0.0

    def add(self, other: GenerationStats) -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                setattr(self, f.name, {k: mine.get(k, 0) + theirs.get(k, 0) for k in {**mine, **theirs}})
            else:
                setattr(self, f.name, mine + theirs)

    def count_point(self, sharpened: bool, certified: bool | None) -> None:
        """One ensemble point decided; ``certified``: settled from engine heads (True), from
        heads completed to full rows (False), or from full rows all along (None)."""
        self.ensemble_ops += 1
        self.sharpened_ops += int(sharpened)
        self.certified_decisions += certified is True
        self.full_decisions += certified is False

    @property
    def ensemble_rate(self) -> float:
        """E/T in percent: ensembled tokens per generated token."""
        return 100.0 * self.ensemble_ops / self.generated_tokens if self.generated_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def ensemble_keep_rate(self) -> float:
        """Share of ensemble points that kept the drafted token (sampling: the acceptance
        rate of speculative sampling's test)."""
        return self.ensemble_kept / self.ensemble_ops if self.ensemble_ops else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def summary(self) -> dict[str, float]:
        data: dict[str, float] = asdict(self)
        data["ensemble_rate_percent"] = round(self.ensemble_rate, 4)
        data["acceptance_rate"] = round(self.acceptance_rate, 4)
        data["ensemble_keep_rate"] = round(self.ensemble_keep_rate, 4)
        data["tokens_per_second"] = round(self.tokens_per_second, 3)
        data["verifier_positions_per_token"] = (
            round(self.verifier_positions / self.generated_tokens, 4)
            if self.generated_tokens
            else 0.0
        )
        # overlap: forwards drafted ahead that no cycle used (rolled back, or past the stop)
        data["speculative_dropped"] = self.drafter_forwards - self.drafted_tokens
        for key in ("forward_depth", "forward_depth_overlapped"):
            data[f"{key}_per_token"] = (
                round(getattr(self, key) / self.generated_tokens, 4) if self.generated_tokens else 0.0
            )
        tokens = self.generated_tokens
        data["engine_calls_per_token"] = round(self.engine_calls / tokens, 4) if tokens else 0.0
        # what a re-submitting engine pays whatever its hardware: ids sent to the members'
        # engines, and of those the ones run through a model (not read from a prefix cache)
        computed = self.prefill_tokens - self.prefill_tokens_saved
        data["submitted_tokens_per_token"] = round(self.prefill_tokens / tokens, 4) if tokens else 0.0
        data["computed_prefill_per_token"] = round(computed / tokens, 4) if tokens else 0.0
        host = max(0.0, self.wall_seconds - self.engine_seconds)
        data["host_ms_per_token"] = round(1000 * host / tokens, 3) if tokens else 0.0
        data["engine_seconds"] = round(self.engine_seconds, 3)
        data["engine_seconds_by_member"] = {k: round(v, 3) for k, v in self.engine_seconds_by_member.items()}
        data["wall_seconds"] = round(self.wall_seconds, 3)
        return data

    def line(self) -> str:
        return (
            f"tokens={self.generated_tokens} ensembles={self.ensemble_ops} "
            f"(kept {self.ensemble_kept}) "
            f"E/T={self.ensemble_rate:.2f}% acceptance={self.acceptance_rate:.3f} "
            f"tok/s={self.tokens_per_second:.2f} verifier_positions={self.verifier_positions}"
        )


# What each view of one request's statistics shows of them, in the order it writes them: named
# here, beside the fields, so that a field renamed or added is renamed or offered everywhere at
# once (tests check every name is a field).
#: a server response's ``safe`` field (with E/T and the acceptance rate)
RESPONSE_COUNTS = (
    "generated_tokens",
    "drafted_tokens",
    "accepted_tokens",
    "ensemble_ops",
    "ensemble_kept",
    "ensemble_replaced",
    "sharpened_ops",
    "cycles",
)
#: a trace line's ``counts`` (the fields ``safe_stats`` sums over the run)
TRACE_COUNTS = (
    "generated_tokens",
    "drafted_tokens",
    "accepted_tokens",
    "cycles",
    "aligned_positions",
    "consensus_skips",
    "ensemble_ops",
    "ensemble_kept",
    "ensemble_replaced",
    "sharpened_ops",
    "misaligned_ensembles",
    "verifier_positions",
)
#: what the speed benchmark keeps of a decoder run beside its time and tokens
BENCH_COUNTS = (
    "cycles",
    "sharpened_ops",
    "aligned_positions",
    "drafter_forwards",
    "forward_depth",
    "forward_depth_overlapped",
)


def counts(stats: GenerationStats, names: Sequence[str]) -> dict[str, Any]:
    """``stats``' values of ``names`` (one of the views above), in their order."""
    return {name: getattr(stats, name) for name in names}


def total(parts: Iterable[GenerationStats]) -> GenerationStats:
    """The sum of several requests' statistics (:meth:`GenerationStats.add`)."""
    out = GenerationStats()
    for part in parts:
        out.add(part)
    return out
