"""One llama.cpp member's token scores of given continuations, as lm-eval's HFLM computes them
(``context + continuation`` left-truncated to ``max_length + 1`` ids, the last not fed; a token
greedy when it is the argmax over the tokenizer's ids).

Pairs run one after another in the order of their ids; each takes the slot (:mod:`.slots`)
holding the longest reusable prefix of it, so the whole blocks of a context shared by a
question's choices or by few-shot exemplars are computed once. Logits are asked at the scored
positions only, one block at a time (a 262k vocabulary makes each row 1 MiB).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lm_eval_safe.engines.llama_cpp.slots import Feed, blocks
from lm_eval_safe.engines.scoring import check_pair

logger = logging.getLogger(__name__)

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
    progress: Callable[[int], Any] | None = None,
) -> list[tuple[list[float], list[bool]]]:
    """Every pair, one after another in the order of their ids, each on a slot of its own fed
    block by block (:mod:`.slots`), logits read at its continuation's positions only."""
    windows = [_window(engine, i, ctx, cont) for i, (ctx, cont) in enumerate(pairs)]
    order = sorted(range(len(pairs)), key=lambda i: windows[i][0])
    out: list[tuple[list[float], list[bool]] | None] = [None] * len(pairs)
    with engine.timed(len(pairs)):
        for index in order:
            out[index] = _score_pair(engine, *windows[index])
            if progress is not None:
                progress(1)
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def _score_pair(engine: Any, ids: list[int], start: int) -> tuple[list[float], list[bool]]:
    """One pair's continuation scores: its slot holds the longest reusable prefix of its
    context, the rest is fed one block per decode (a block's logits, ``n_batch`` rows at most,
    turned into scores before the next is fed)."""
    slots = engine.slots
    slot = slots.take(ids)
    logprobs: list[float] = []
    greedy: list[bool] = []
    try:
        first = start - 1  # the position whose logits score the continuation's first id
        at = slots.prepare(slot, ids, first, new=True)
        end = len(ids) - 1  # the last id is scored, never fed
        for begin, stop in blocks(at, end, slots.block):
            want = list(range(max(first, begin), stop))
            (logits,) = slots.decode([Feed(slot, begin, ids[begin:stop], want)])
            if not want:
                continue
            rows = engine.vocab_logits(logits)
            targets = torch.tensor([ids[p + 1] for p in want], dtype=torch.long)
            picked = rows.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(rows, dim=-1)
            logprobs.extend(picked.tolist())
            greedy.extend((rows.argmax(dim=-1) == targets).tolist())
    finally:
        slots.give_back(slot)
    return logprobs, greedy
