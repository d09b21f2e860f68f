"""One llama.cpp member's token scores of given continuations, as lm-eval's HFLM computes them
(``context + continuation`` left-truncated to ``max_length + 1`` ids, the last not fed; a token
greedy when it is the argmax over the tokenizer's ids).

Pairs run in the order of their ids, several at once as sequences of one decode; each takes the
slot (:mod:`.slots`) holding the longest prefix of it, so a context shared by a question's
choices or by few-shot exemplars is computed once and copied. Logits are asked at the scored
positions only, a bounded number per decode (a 262k vocabulary makes each row 1 MiB).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lm_eval_safe.engines.llama_cpp.slots import Feed, common_prefix
from lm_eval_safe.engines.scoring import check_pair

logger = logging.getLogger(__name__)

#: Most logits (floats) one decode returns: 2**25 floats, 128 MiB.
LOGITS_BUDGET = 1 << 25


def _window(engine: Any, index: int, ctx: list[int], cont: list[int]) -> tuple[list[int], int]:
    """The pair's ids as HFLM windows them, and where its continuation starts."""
    member = engine.member
    check_pair(member, index, ctx, cont)
    limit = member.max_length
    if len(ctx) + len(cont) > limit + 1:
        logger.warning(
            "context+continuation (%d tokens) exceed %s's window %d; truncating from the left",
            len(ctx) + len(cont),
            member.name,
            limit,
        )
        ctx = ctx[len(ctx) + len(cont) - limit - 1 :]
    return ctx + cont, len(ctx)


def score_tokens(
    engine: Any,
    pairs: Sequence[tuple[list[int], list[int]]],
    batch_size: int | str,
    progress: Callable[[int], Any] | None = None,
) -> list[tuple[list[float], list[bool]]]:
    windows = [_window(engine, i, ctx, cont) for i, (ctx, cont) in enumerate(pairs)]
    order = sorted(range(len(pairs)), key=lambda i: windows[i][0])
    slots = engine.slots
    rows = slots.free if batch_size == "auto" else max(1, min(int(batch_size), slots.free))
    out: list[tuple[list[float], list[bool]] | None] = [None] * len(pairs)
    with engine.timed(len(pairs)):
        for at in range(0, len(order), rows):
            group = order[at : at + rows]
            _score_group(engine, [windows[i] for i in group], group, out)
            if progress is not None:
                progress(len(group))
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def _score_group(
    engine: Any,
    windows: list[tuple[list[int], int]],
    indices: list[int],
    out: list[tuple[list[float], list[bool]] | None],
) -> None:
    """Each pair on a slot of its own, fed in chunks of at most ``LOGITS_BUDGET`` logits in all.
    A pair sharing a prefix with an earlier one of the group (its leader: a question's other
    choices) starts once the leader has fed that prefix, and copies it."""
    slots = engine.slots
    per_decode = max(1, LOGITS_BUDGET // (engine.model.n_vocab * len(windows)))
    taken = [slots.take(ids) for ids, _ in windows]
    leader = list(range(len(windows)))
    shared = [0] * len(windows)
    for k in range(1, len(windows)):
        first = leader[k - 1]
        common = common_prefix(windows[k][0], windows[first][0])
        if common > 1:
            leader[k], shared[k] = first, min(common, windows[k][1] - 1)
    cursor: list[int | None] = [None] * len(windows)
    scores: list[tuple[list[float], list[bool]]] = [([], []) for _ in windows]
    try:
        while True:
            feeds, active = [], []
            fed = list(cursor)  # what earlier decodes fed (this round's feeds run below)
            for k, (ids, start) in enumerate(windows):
                if cursor[k] is None:
                    lead = fed[leader[k]]
                    if leader[k] != k and (lead is None or lead < shared[k]):
                        continue  # the leader feeds the shared prefix first
                    cursor[k] = slots.prepare(taken[k], ids, start - 1, prompt=True)
                at = cursor[k]
                assert at is not None
                end = len(ids) - 1  # the last id is scored, never fed
                if at >= end:
                    continue
                first = max(at, start - 1)
                stop = min(end, first + per_decode)
                feeds.append(Feed(taken[k], at, ids[at:stop], list(range(first, stop))))
                active.append(k)
                cursor[k] = stop
            if not feeds:
                break
            for k, feed, logits in zip(active, feeds, slots.decode(feeds), strict=True):
                ids = windows[k][0]
                rows = engine.vocab_logits(logits)
                targets = torch.tensor([ids[p + 1] for p in feed.want], dtype=torch.long)
                picked = rows.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(rows, dim=-1)
                scores[k][0].extend(picked.tolist())
                scores[k][1].extend((rows.argmax(dim=-1) == targets).tolist())
        for index, score in zip(indices, scores, strict=True):
            out[index] = score
    finally:
        for slot in taken:
            slots.give_back(slot)
