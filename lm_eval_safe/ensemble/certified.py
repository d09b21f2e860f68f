"""Ensemble decisions certified from the head of each member's distribution (docs/algorithm.md, Decisions from engine heads).

An engine such as vLLM returns, per position, the ``K`` most probable ids and the log-probs of
the ids it was asked about (:class:`~lm_eval_safe.engines.base.TopLogprobs`), not the whole
vocabulary. Every id it did not return is at most as probable as the ``K``-th, and all of them
together hold the mass the returned ones leave. So each quantity a decision reads (a member's
probability of a string, the mixture, UniTE's renormalised table, a sharpened score) lies in an
interval computed from the head alone. Where the intervals separate the winner from every
other string, and every threshold test (sharpening's trigger at 0.5, ``sharpen_lambda``, SAFE's
consensus at 0.5) falls clearly on one side, the decision is the one the full distributions
would give: it is *certified*. Anything else returns ``None`` and the decoder asks the engines
for the full distributions (:class:`~lm_eval_safe.engines.base.Complete`), on which the exact
code of :mod:`lm_eval_safe.ensemble.aggregate` decides.

The rules mirror :func:`~lm_eval_safe.ensemble.aggregate.gac` and :func:`~lm_eval_safe.ensemble.aggregate.unite`
step by step; ``tests/ensemble/test_certified.py`` checks every certified decision against those
functions on the full distributions the heads were cut from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lm_eval_safe.engines.base import MASS_SLACK, TopLogprobs
from lm_eval_safe.ensemble.aggregate import (
    SHARPEN_THRESHOLD,
    Choice,
    UnionVocabulary,
    View,
    member_token_for,
    normalised_weights,
    weights_used,
)

#: Separation every certified comparison needs: more than the rounding of the float32
#: log-probs an engine returns, far less than any difference a decision turns on in practice.
MARGIN = 1e-7


def as_head(view: View, k: int) -> View:
    """A full row as a head of ``k`` ids, so members on a transformers engine and on a head-only
    one decide together (``engines=hf,vllm``); heads stay as they are."""
    row = view.logprobs
    if isinstance(row, TopLogprobs):
        return view
    top = torch.topk(row, min(k, row.numel()))
    ids, logprobs = top.indices.tolist(), top.values.tolist()
    head = TopLogprobs(ids, logprobs, dict(zip(ids, logprobs, strict=True)))
    return View(head, view.vocab, view.tokenizer, view.weight)


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def __add__(self, other: Interval) -> Interval:
        return Interval(self.low + other.low, self.high + other.high)

    def scaled(self, weight: float) -> Interval:
        return Interval(weight * self.low, weight * self.high)

    def log(self) -> Interval:
        return Interval(_log(self.low), _log(self.high))

    def above(self, bound: float) -> bool | None:
        """``value > bound`` when certain, else None."""
        if self.low > bound + MARGIN:
            return True
        if self.high <= bound - MARGIN:
            return False
        return None


ZERO = Interval(0.0, 0.0)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


@dataclass
class Head:
    """One member's returned head, with the bound on every id it does not name."""

    row: TopLogprobs
    weight: float

    def __post_init__(self) -> None:
        self.left = min(1.0, self.row.remaining + MASS_SLACK)  # mass outside `known`
        self.unknown = min(self.row.ceiling, self.left)  # bound on any one unknown id

    def token(self, token: int) -> Interval:
        lp = self.row.known.get(token)
        if lp is not None:
            p = math.exp(lp)
            return Interval(p, p)
        return Interval(0.0, self.unknown)

    def tokens(self, ids: Sequence[int]) -> Interval:
        """The probability of a string several ids spell (summed, as GaC's union map sums)."""
        known = sum(math.exp(self.row.known[t]) for t in ids if t in self.row.known)
        missing = sum(1 for t in ids if t not in self.row.known)
        return Interval(known, known + min(self.left, missing * self.unknown))


def _top_keys(view: View, k: int) -> list[bytes] | None:
    """The keys of the row's ``k`` most probable ids in :func:`~lm_eval_safe.ensemble.aggregate.top_ids`'s
    order (equal values by id), whatever order the engine listed them in; None where the head
    cannot tell which ids they are: an id it does not know may equal the k-th value (no unknown
    id exceeds the head's last value), so a tie at the k-th place may reach past the head."""
    row = view.logprobs
    assert isinstance(row, TopLogprobs)
    k = min(k, len(view.vocab.keys))
    ranked = sorted(row.known.items(), key=lambda item: (-item[1], item[0]))
    if len(ranked) < k:
        return None
    if len(ranked) < len(view.vocab.keys) and ranked[k - 1][1] <= row.logprobs[-1]:
        return None
    return [view.vocab.keys[t] for t, _ in ranked[:k]]


def short_heads(views: Sequence[View], top_k: int) -> list[int]:
    """The views whose head names fewer ids than the top-k lists the rule reads (an engine
    asked for the argmax alone): it cannot say which strings are the candidates."""
    return [
        slot
        for slot, v in enumerate(views)
        if isinstance(v.logprobs, TopLogprobs) and len(v.logprobs.ids) < min(top_k, len(v.vocab.keys))
    ]


def _unique_winner(scores: dict[bytes, Interval], others_high: float = -math.inf) -> bytes | None:
    """The key whose low bound beats every other key's high bound (and ``others_high``)."""
    if not scores:
        return None
    best = max(scores, key=lambda k: scores[k].low)
    rival = max([others_high, *(v.high for k, v in scores.items() if k != best)])
    return best if scores[best].low > rival + MARGIN else None


def _sharpened(
    choice: Choice,
    best_score: Interval,
    scores: dict[bytes, Interval],
    drafter_top: list[bytes],
    candidates: list[bytes],
    lam: float,
) -> Choice | None:
    """:func:`lm_eval_safe.ensemble.aggregate._sharpen` and the comparison after it, on intervals."""
    sharpened = dict(scores)
    absorbed: dict[bytes, list[bytes]] = {}
    for s in drafter_top:
        if s not in scores:
            continue
        if s.strip() == b"" or s.startswith(b"\x00"):
            continue  # aggregate._can_absorb refuses these whatever their probability
        absorbs = scores[s].above(lam)
        if absorbs is None:
            return None
        if not absorbs:
            continue
        extensions = [c for c in candidates if c != s and c.startswith(s)]
        absorbed[s] = extensions
        total = scores[s]
        for c in extensions:
            total = total + scores.get(c, ZERO)
        sharpened[s] = total
    winner = _unique_winner(sharpened)
    if winner is None:
        return None
    if winner == choice.key:
        extensions = absorbed.get(winner, [])
        gain_low = sum(scores.get(c, ZERO).low for c in extensions)
        gain_high = sum(scores.get(c, ZERO).high for c in extensions)
        if gain_high <= 0.0:
            return choice
        if gain_low <= 0.0:
            return None
        return Choice(winner, sharpened[winner].low, True)
    if sharpened[winner].low > best_score.high + MARGIN:
        return Choice(winner, sharpened[winner].low, True)
    if sharpened[winner].high < best_score.low - MARGIN:
        return choice
    return None


def _decide(
    per_member: Sequence[dict[bytes, Interval]],
    weights: Sequence[float],
    keys: Sequence[bytes],
    sharpen: str,
    lam: float,
    candidates: list[bytes],
    drafter_top: list[bytes],
    unseen: tuple[float, float] = (0.0, -math.inf),
) -> Choice | None:
    """The aggregate's decision over ``keys`` from each member's intervals, as the exact
    aggregators take it: the mixture's argmax, sharpened when its maximum is below 0.5
    (heuristically, or by the weighted geometric mean's argmax). ``unseen``: bounds of any
    string outside ``keys`` (mixture, log)."""
    mixture = {
        key: sum((m[key].scaled(w) for m, w in zip(per_member, weights, strict=True)), ZERO)
        for key in keys
    }
    if sharpen == "geometric":
        smooth = _below_threshold(mixture, unseen[0])
        if smooth is None:
            return None
        if smooth:
            return _geometric(per_member, weights, keys, unseen[1])
    best = _unique_winner(mixture, unseen[0])
    if best is None:
        return None
    choice = Choice(best, mixture[best].low, False)
    if sharpen != "heuristic":
        return choice
    trigger = mixture[best].above(SHARPEN_THRESHOLD)
    if trigger is None:
        return None
    if trigger:  # the maximum is at least 0.5: no sharpening
        return choice
    scores = {key: mixture[key] for key in candidates if key in mixture}
    return _sharpened(choice, mixture[best], scores, drafter_top, candidates, lam)


def _below_threshold(mixture: dict[bytes, Interval], unseen: float) -> bool | None:
    """Whether the mixture's maximum is below 0.5 (the trigger of every sharpening), when the
    bounds settle it: one string surely at 0.5 or more says no, every string (and any string
    outside ``mixture``, at most ``unseen``) surely below says yes."""
    if any(v.above(SHARPEN_THRESHOLD) for v in mixture.values()):
        return False
    if max([unseen, *(v.high for v in mixture.values())]) <= SHARPEN_THRESHOLD - MARGIN:
        return True
    return None


def _geometric(
    per_member: Sequence[dict[bytes, Interval]], weights: Sequence[float], keys: Sequence[bytes], unseen_log: float
) -> Choice | None:
    """The weighted geometric mean's argmax (geometric sharpening), when the bounds settle it."""
    used = weights_used(weights)  # as the exact rules: weight 0 takes no part
    scores = {key: sum((per_member[m][key].log().scaled(weights[m]) for m in used), ZERO) for key in keys}
    finite = {k: v for k, v in scores.items() if v.low > -math.inf}
    rivals = [unseen_log, *(v.high for k, v in scores.items() if k not in finite)]
    best = _unique_winner(finite, max(rivals))
    return None if best is None else Choice(best, math.exp(scores[best].low), True)


def _heads(views: Sequence[View], weights: Sequence[float]) -> list[Head]:
    heads = []
    for view, weight in zip(views, weights, strict=True):
        assert isinstance(view.logprobs, TopLogprobs)
        heads.append(Head(view.logprobs, weight))
    return heads


def certified_gac(
    views: Sequence[View], union: UnionVocabulary, sharpen: str, lam: float, top_k: int
) -> Choice | None:
    """:func:`lm_eval_safe.ensemble.aggregate.gac` from heads, or None where they do not settle it.

    A string's probability in a member sums its ids (as GaC's union map does); a string no
    member's head names is at most every member's bound on an unknown id (times the most ids
    one string has in that vocabulary)."""
    weights = normalised_weights(views)
    if sharpen == "heuristic" and short_heads(views, top_k):
        return None
    heads = _heads(views, weights)
    seen = list(
        dict.fromkeys(view.vocab.keys[t] for view, head in zip(views, heads, strict=True) for t in head.row.known)
    )
    per_member = [
        {key: head.tokens(view.vocab.ids_of.get(key, ())) for key in seen}
        for view, head in zip(views, heads, strict=True)
    ]
    unseen = [min(h.left, view.vocab.most_ids_per_key * h.unknown) for view, h in zip(views, heads, strict=True)]
    bounds = (
        sum(w * u for w, u in zip(weights, unseen, strict=True)),
        sum(weights[m] * _log(unseen[m]) for m in weights_used(weights)),
    )
    tops: list[list[bytes] | None] = [[] for _ in views]  # sharpening alone reads the top-k
    if sharpen == "heuristic":
        tops = [_top_keys(view, top_k) for view in views]
    if any(top is None for top in tops):
        return None
    candidates = list(dict.fromkeys(k for top in tops for k in top or ()))
    return _decide(per_member, weights, seen, sharpen, lam, candidates, tops[0] or [], bounds)


def _unite_member(view: View, head: Head, keys: list[bytes]) -> dict[bytes, Interval]:
    """One member's row of UniTE's table (its softmax over the union of top-k strings), as
    intervals: a string it has no id for, or cannot spell, is 0 there as in the exact rule."""
    entries: list[int | None] = [member_token_for(view, key) for key in keys]
    known_total = sum(head.token(t).low for t in entries if t is not None and t in head.row.known)
    counts: dict[int, int] = {}
    for t in entries:
        if t is not None and t not in head.row.known:
            counts[t] = counts.get(t, 0) + 1
    unknown_high = min(
        sum(counts.values()) * head.unknown, max(counts.values(), default=0) * head.left
    )
    row: dict[bytes, Interval] = {}
    for key, t in zip(keys, entries, strict=True):
        if t is None:
            row[key] = ZERO
        elif t in head.row.known:
            p = head.token(t).low
            row[key] = Interval(p / (known_total + unknown_high), p / known_total)
        else:
            c = head.unknown
            row[key] = Interval(0.0, c / (known_total + counts[t] * c) if c > 0 else 0.0)
    return row


def certified_unite(views: Sequence[View], sharpen: str, lam: float, top_k: int) -> Choice | None:
    """:func:`lm_eval_safe.ensemble.aggregate.unite` from heads, or None where they do not settle it."""
    if short_heads(views, top_k):
        return None
    tops = [_top_keys(view, top_k) for view in views]
    if any(top is None for top in tops):
        return None
    weights = normalised_weights(views)
    keys = list(dict.fromkeys(k for top in tops for k in top or ()))
    rows = []
    for view, head in zip(views, _heads(views, weights), strict=True):
        if head.weight == 0:  # takes no part: its row is never read
            rows.append(dict.fromkeys(keys, ZERO))
            continue
        row = _unite_member(view, head, keys)
        if not any(t.low > 0 for t in row.values()):
            return None  # a member none of whose entries is known: its normaliser is unbounded
        rows.append(row)
    return _decide(rows, weights, keys, sharpen, lam, keys, tops[0] or [])


def certified_consensus(
    verifier_argmax_is_own: Sequence[bool], own: Sequence[Interval], weights: Sequence[float]
) -> bool | None:
    """SAFE's skip rule (:func:`lm_eval_safe.ensemble.consensus.consensus`) on bounds of each member's
    probability of its own next token; None when the bounds straddle rule (b)'s 0.5."""
    if all(verifier_argmax_is_own):
        return True
    total = sum(weights)
    mean = Interval(
        sum(w * p.low for w, p in zip(weights, own, strict=True)) / total,
        sum(w * p.high for w, p in zip(weights, own, strict=True)) / total,
    )
    return mean.above(0.5)
