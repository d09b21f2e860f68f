"""What every engine's ``score_tokens`` checks of a pair before scoring it, and the error that
names the request (:func:`lm_eval_safe.scoring.pairs.score_members` turns it into one line)."""

from __future__ import annotations

from typing import Any

from lm_eval_safe.errors import UserError


class ScoringError(UserError, ValueError):
    """A request that cannot be scored; ``index`` says which, so the caller can name it."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def check_pair(member: Any, index: int, ctx: list[int], cont: list[int]) -> None:
    """A pair the member's engine can score: a continuation to score, no longer than one of its
    scoring windows (``rolling_window``: vLLM's is two ids short of ``max_length``), and a
    context token to condition on (lm-eval puts the prefix token in an empty context)."""
    if not cont:
        raise ScoringError(index, f"{member.name} has no continuation tokens to score")
    window = member.engine.rolling_window
    if len(cont) > window:
        raise ScoringError(
            index,
            f"continuation of {len(cont)} tokens is longer than {member.name}'s scoring window "
            f"({window}) on its {member.engine.kind} engine; give a larger max_length= (now "
            f"{member.max_length}) or a shorter continuation",
        )
    if not ctx:
        raise ScoringError(index, f"{member.name} has no context token to condition on")
