"""Sequential forward depth: what a GPU's decoding latency follows (docs/algorithm.md, The paper's numbers: "close to
single-model latency").

On a GPU a forward over a few new tokens of a small model costs about what a one-token forward
does (it is bound by kernel launches and weight reads, not by arithmetic), so latency follows
the number of forwards that have to run one after another, not the tokens they hold. A cycle
drafts (one drafter forward per token), then verifies (each verifier's forwards). Run in that
order the depth is every forward. With the verifiers beside the next draft
(:mod:`lm_eval_safe.decoder.overlap`), a verification whose window is kept hides behind the next
cycle's drafting; only a replacement (the speculative draft is dropped), the last cycle and a
verification longer than the next draft keep the drafter waiting.

This is a model, computed from counted forwards with per-forward costs as its only inputs
(one per forward in ``safe_stats``; ``lm-eval-safe bench speed`` uses latencies measured for 1
and 5 rows), not a measurement of any device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class CycleForwards:
    """The forwards one SAFE cycle needed, and whether its window was replaced."""

    drafter: int = 0  # drafter forwards that produced the cycle's drafted tokens
    verifiers: list[list[int]] = field(default_factory=list)  # per verifier: rows of each forward
    replaced: bool = False


def unit_cost(_member: int, _rows: int) -> float:
    """Every forward costs one: the latency-bound limit of a GPU."""
    return 1.0


def forward_depth(
    cycles: Sequence[CycleForwards], cost: Callable[[int, int], float] = unit_cost
) -> tuple[float, float]:
    """``(sequential, overlapped)`` depth of one request's cycles. ``cost(member, rows)`` is a
    forward's latency (member 0 the drafter, ``k`` the ``k``-th verifier).

    Overlapped: verifiers run on their own devices, at once; cycle ``k``'s verification starts
    when its draft ends, and the drafter drafts cycle ``k+1`` meanwhile. Kept, the next
    verification starts after ``max(next draft, this verification)``; replaced, the
    speculative draft is dropped and the next draft starts after the verification."""
    sequential = overlapped = waiting = 0.0
    for cycle in cycles:
        draft = cycle.drafter * cost(0, 1)
        verify = [sum(cost(k, rows) for rows in forwards) for k, forwards in enumerate(cycle.verifiers, 1)]
        sequential += draft + sum(verify)
        overlapped += draft + max(0.0, waiting - draft)
        waiting = max(verify, default=0.0)
        if cycle.replaced:
            overlapped += waiting
            waiting = 0.0
    return sequential, overlapped + waiting
