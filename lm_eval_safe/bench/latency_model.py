"""The modelled GPU ratio of ``lm-eval-safe bench speed``: each run's counted forwards
(:mod:`lm_eval_safe.decoder.latency`) priced with per-forward latencies measured on this machine.

Inputs, and nothing else: each member's latency of one forward over 1 and over 5 new tokens
after a cached prompt (rows in between interpolated). A forward over more rows (a verifier's
prompt, a long backlog) is priced as one over 5: on a latency-bound device a few hundred
tokens of a small model cost about what a few do, and a CPU's per-row cost would otherwise
charge the verifier's prefill as if it were the GPU's. The model then adds the forwards that
must run one after another, in turn or overlapped. It is a model, stated as such, not a
measurement; on a GPU ``lm-eval-safe bench speed --member-devices cuda:0,cuda:1`` with the
``safe_*_overlap`` methods measures the real ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lm_eval_safe.decoder.latency import CycleForwards, forward_depth
from lm_eval_safe.engines import instruments
from lm_eval_safe.members.member import Member


@dataclass
class ForwardLatency:
    """One member's measured seconds per forward over 1 and 5 new tokens."""

    one_row: float
    five_rows: float

    def seconds(self, rows: int) -> float:
        rows = min(max(rows, 1), 5)
        return self.one_row + (rows - 1) * (self.five_rows - self.one_row) / 4


def measure_latency(member: Member, prompt_ids: list[int], repeats: int = 7) -> ForwardLatency:
    """Median time of a 1-token and a 5-token forward after ``prompt_ids`` (the cache cropped
    back after each), all rows through the output layer, as a verifier's window needs: the
    member's engine times its own forwards (its instruments)."""
    return ForwardLatency(*instruments(member).forward_seconds(member, prompt_ids, repeats))


def cost_function(latencies: Sequence[ForwardLatency]) -> Callable[[int, int], float]:
    """``cost(member, rows)`` for :func:`~lm_eval_safe.decoder.latency.forward_depth`: drafter first."""
    return lambda member, rows: latencies[member].seconds(rows)


def modelled_seconds(
    requests: Sequence[Sequence[CycleForwards]], latencies: Sequence[ForwardLatency]
) -> tuple[float, float]:
    """``(in turn, overlapped)`` modelled seconds of the requests' cycles."""
    cost = cost_function(latencies)
    depths = [forward_depth(cycles, cost) for cycles in requests]
    return sum(d[0] for d in depths), sum(d[1] for d in depths)
