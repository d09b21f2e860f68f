"""Scoring given continuations (loglikelihood) with an ensemble: docs/algorithm.md, Scoring.

Each member scores every request's tokens on its own engine (``MemberEngine.score_tokens``); the
continuation is then cut at byte offsets that are token boundaries of *every* member and the
segment probabilities are aggregated (:mod:`lm_eval_safe.scoring.loglikelihood`). Here: how lm-eval
tokenizes a pair, and one progress bar over every member's scoring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval_safe.engines import engines_active
from lm_eval_safe.engines.scoring import ScoringError
from lm_eval_safe.errors import RequestError
from lm_eval_safe.members.member import Member


def encode_pair(
    member: Member, context: str, continuation: str
) -> tuple[list[int], list[int], str]:
    """Tokenize as lm-eval's HFLM: jointly, split at the context's tokens, trailing context
    spaces moved into the continuation; an empty context becomes the member's prefix token.
    Returns context ids, continuation ids and the continuation text they stand for."""
    context = member.render_context(context)
    if context == "":
        cont = member.encode(continuation, add_special_tokens=False)
        if not cont:
            raise RequestError("empty continuation with an empty context: nothing to score")
        if member.prefix_token_id != cont[0]:
            return [member.prefix_token_id], cont, continuation
        return cont[:1], cont[1:], continuation
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = member.encode(context + continuation)
    ctx = member.encode(context)
    return ctx, whole[len(ctx) :], continuation


def score_members(
    members: Sequence[Member],
    all_pairs: Sequence[list[tuple[list[int], list[int]]]],
    options: Any,
    kind: str,
    labels: Sequence[Any],
    disable_tqdm: bool = False,
) -> list[list[tuple[list[float], list[bool]]]]:
    """Each member's engine's ``score_tokens`` for every pair (``options.batch_size`` / ``max_batch_size``), one
    progress bar; a bad pair fails in one line naming the request (``labels[i]``)."""
    from tqdm import tqdm

    results = []
    with engines_active(members), tqdm(
        total=sum(len(p) for p in all_pairs), disable=disable_tqdm, desc=f"Running {kind} requests"
    ) as bar:
        for member, pairs in zip(members, all_pairs, strict=True):
            try:
                results.append(
                    member.engine.score_tokens(
                        pairs, options.batch_size, options.max_batch_size, progress=bar.update
                    )
                )
            except ScoringError as exc:
                label = labels[exc.index] if exc.index < len(labels) else exc.index
                raise RequestError(f"{kind} request {label!r}: {exc}") from None
    return results
