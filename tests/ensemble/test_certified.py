"""Decisions from an engine's head (top-K log-probs) against the full-vocabulary decisions.

Why: a vLLM member returns only its ``K`` most probable ids per position. A decision the decoder
takes from those heads (GaC's and UniTE's argmax, sharpening, SAFE's consensus skip) must be the
one the full distributions give, or the engine changes texts silently. Each trial cuts random
full distributions down to heads, asks :mod:`lm_eval_safe.ensemble.certified`, and compares every
certified answer with :func:`~lm_eval_safe.ensemble.aggregate.gac` / :func:`~lm_eval_safe.ensemble.aggregate.unite`
run on the full distributions the heads came from. The vocabularies share strings and prefix
families ("The", "Th", "T", "Then"), so sharpening triggers and members disagree.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from aggregate_cases import member

from lm_eval_safe.engines.base import TopLogprobs
from lm_eval_safe.ensemble.aggregate import UnionVocabulary, View, gac, unite
from lm_eval_safe.ensemble.certified import (
    Interval,
    certified_consensus,
    certified_gac,
    certified_unite,
)
from lm_eval_safe.ensemble.consensus import consensus

POOL = [
    "The", "Th", "T", "Then", "There", " the", " th", " t", " then", " cat", " ca", " c",
    "a", "an", "and", " a", " an", "x", "y", "z", "1", "12", "123", " ", "\n", "<eos>",
]  # fmt: skip
LETTERS = ["T", "h", "e", "n", "r", " ", "t", "c", "a", "d", "x", "y", "z", "1", "2", "3", "\n", "<eos>"]


def _random_member(rng: random.Random, weight: float) -> View:
    strings = list(dict.fromkeys(LETTERS + rng.sample(POOL, rng.randint(8, len(POOL)))))
    scale = rng.choice([0.5, 1.5, 3.0, 6.0])
    logits = torch.tensor([rng.gauss(0.0, scale) for _ in strings], dtype=torch.float64)
    for favourite in rng.sample(range(len(strings)), 2):  # a couple of strong candidates
        logits[favourite] += rng.uniform(0.0, 2 * scale)
    probs = torch.softmax(logits, dim=0)
    return member(dict(zip(strings, probs.tolist(), strict=True)), weight)


def _head(view: View, k: int, rng: random.Random) -> View:
    """The view as an engine answers it: its k most probable ids, plus one other id whose
    log-prob was asked for (a drafted or scored token)."""
    full = view.logprobs
    top = torch.topk(full, min(k, full.numel()))
    known = {int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)}
    extra = rng.randrange(full.numel())
    known[extra] = float(full[extra])
    row = TopLogprobs(
        [int(i) for i in top.indices], [float(v) for v in top.values], known
    )
    return View(row, view.vocab, view.tokenizer, view.weight)


def _trials(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        weights = [rng.choice([1.0, 1.0, 2.0, 0.5]) for _ in range(rng.choice([2, 2, 3]))]
        full = [_random_member(rng, w) for w in weights]
        k = rng.choice([3, 5, 8, 10])
        top_k = rng.choice([t for t in (2, 3, 5, 10) if t < k])  # engines' heads: top_k + 1 ids or more
        yield full, [_head(v, k, rng) for v in full], top_k


@pytest.mark.parametrize("sharpen", ["heuristic", "none", "geometric"])
@pytest.mark.parametrize("aggregator", ["gac", "unite"])
def test_certified_decisions_equal_full_vocabulary_ones(aggregator: str, sharpen: str) -> None:
    certified = undecided = sharpened = 0
    seed = ["gac", "unite"].index(aggregator) * 10 + ["heuristic", "none", "geometric"].index(sharpen)
    for full, heads, top_k in _trials(seed=seed, n=400):
        lam = 0.1
        if aggregator == "gac":
            union = UnionVocabulary.build([v.vocab for v in full])
            exact = gac(full, union, sharpen, lam, top_k)
            got = certified_gac(heads, union, sharpen, lam, top_k)
        else:
            exact = unite(full, sharpen, lam, top_k)
            got = certified_unite(heads, sharpen, lam, top_k)
        if got is None:
            undecided += 1
            continue
        certified += 1
        sharpened += int(exact.sharpened)
        assert (got.key, got.sharpened) == (exact.key, exact.sharpened)
        assert got.probability <= exact.probability + 1e-6
    # both outcomes occur, and heads settle many decisions (the geometric mean fewest: a string
    # outside a member's head has no lower bound above 0 there, so its log-mean none above -inf)
    assert certified > (50 if sharpen == "geometric" else 150) and undecided > 0, (certified, undecided)
    if sharpen == "heuristic":
        assert sharpened > 5, sharpened


@pytest.mark.parametrize("aggregator", ["gac", "unite"])
def test_whole_distribution_as_head_always_certifies(aggregator: str) -> None:
    """With every id known the bounds are exact: only float ties may stay undecided."""
    rng = random.Random(5)
    undecided = 0
    for _ in range(100):
        full = [_random_member(rng, 1.0) for _ in range(2)]
        heads = [_head(v, v.logprobs.numel(), rng) for v in full]
        if aggregator == "gac":
            union = UnionVocabulary.build([v.vocab for v in full])
            exact, got = gac(full, union, "heuristic", 0.1, 10), certified_gac(heads, union, "heuristic", 0.1, 10)
        else:
            exact, got = unite(full, "heuristic", 0.1, 10), certified_unite(heads, "heuristic", 0.1, 10)
        if got is None:
            undecided += 1
            continue
        assert (got.key, got.sharpened) == (exact.key, exact.sharpened)
    assert undecided <= 2


def test_an_unseen_string_can_win_so_the_head_must_not_decide() -> None:
    """Two members each put 0.30 on a string neither shows in its top-2 heads? Impossible, but
    0.2 each on a string below their heads' last entry (0.21) can beat every string shown: the
    unseen bound must keep the decision open."""
    a = member({"A": 0.4, "B": 0.21, "C": 0.2, "x": 0.19})
    b = member({"D": 0.4, "E": 0.21, "C": 0.2, "y": 0.19})
    union = UnionVocabulary.build([a.vocab, b.vocab])
    exact = gac([a, b], union, "none", 0.1, 2)
    assert exact.key == b"A" or exact.key == b"D"  # 0.2 each; C = 0.2 ties neither
    heads = [_head(v, 2, random.Random(0)) for v in (a, b)]
    for view in heads:  # drop the extra id: only the top-2 are known
        view.logprobs.known = dict(zip(view.logprobs.ids, view.logprobs.logprobs, strict=True))
    assert certified_gac(heads, union, "none", 0.1, 2) is None
    # with C known in both members the head settles it
    c = [member({"A": 0.6, "B": 0.21, "C": 0.1, "x": 0.09}), member({"A": 0.5, "E": 0.3, "C": 0.1, "y": 0.1})]
    union = UnionVocabulary.build([v.vocab for v in c])
    heads = [_head(v, 2, random.Random(0)) for v in c]
    assert certified_gac(heads, union, "none", 0.1, 2).key == gac(c, union, "none", 0.1, 2).key == b"A"


@pytest.mark.parametrize("seed", range(5))
def test_certified_consensus_agrees_with_the_rule(seed: int) -> None:
    rng = random.Random(seed)
    decided = 0
    for _ in range(300):
        n = rng.choice([2, 3])
        weights = [rng.choice([1.0, 2.0]) for _ in range(n)]
        probs = [rng.random() for _ in range(n)]
        argmax_is_own = [rng.random() < 0.3 for _ in range(n - 1)]
        exact = consensus(argmax_is_own, probs, weights)
        bounds = []
        for p in probs:  # some known exactly, some only bounded by a ceiling
            if rng.random() < 0.5:
                bounds.append(Interval(p, p))
            else:
                bounds.append(Interval(0.0, min(1.0, p + rng.random() * 0.2)))
        got = certified_consensus(argmax_is_own, bounds, weights)
        if got is not None:
            decided += 1
            assert got == exact
    assert decided > 150


def test_head_bounds() -> None:
    row = TopLogprobs([3, 1], [math.log(0.5), math.log(0.2)], {3: math.log(0.5), 1: math.log(0.2), 7: math.log(0.05)})
    assert row.argmax == 3 and row.ceiling == pytest.approx(0.2)
    assert row.remaining == pytest.approx(0.25)
    assert row.probability_bounds(7) == pytest.approx((0.05, 0.05))
    assert row.probability_bounds(9) == pytest.approx((0.0, 0.2))


def _byte_member(table: dict[bytes, float], weight: float) -> View:
    """A member whose strings may be bytes that are no UTF-8 text (a byte-level BPE's piece of
    a multi-byte character): another member has no id for such a string (UniTE reads it as
    probability 0, GaC's union has no entry of that member for it)."""
    from aggregate_cases import GreedyTokenizer, vocabulary

    keys = list(table)
    vocab = vocabulary(keys)
    spelled = [key.decode("utf-8", errors="replace") for key in keys]
    probs = torch.tensor([table[k] for k in keys], dtype=torch.float64)
    return View(probs.log(), vocab, GreedyTokenizer(spelled), weight)


@pytest.mark.parametrize("aggregator", ["gac", "unite"])
def test_a_zero_weight_member_takes_no_part_in_the_geometric_mean(aggregator: str) -> None:
    """``weights=1,0`` with ``sharpen=geometric``: the second member's log-probabilities count
    0 times, also for a string it has no id for (0 x log 0 is not a number: p ** 0 = 1).

    By hand: A = {b: 0.45, \\xe6: 0.4, c: 0.15} with weight 1 decides alone; its mixture is
    smooth (0.45 < 0.5), so the weighted log-mean decides, and it is A's own distribution
    (UniTE's softmax over the union {b, \\xe6, c} is A's, as A spells all three): b wins with
    0.45. B = {b: 0.3, c: 0.7} cannot spell the byte string \\xe6. The decision from heads
    that know every id is the same."""
    a = _byte_member({b"b": 0.45, b"\xe6": 0.4, b"c": 0.15}, 1.0)
    b = _byte_member({b"b": 0.3, b"c": 0.7}, 0.0)
    heads = [_head(v, v.logprobs.numel(), random.Random(0)) for v in (a, b)]
    if aggregator == "gac":
        union = UnionVocabulary.build([a.vocab, b.vocab])
        exact = gac([a, b], union, "geometric", 0.1, 10)
        certified = certified_gac(heads, union, "geometric", 0.1, 10)
    else:
        exact = unite([a, b], "geometric", 0.1, 10)
        certified = certified_unite(heads, "geometric", 0.1, 10)
    assert (exact.key, exact.sharpened) == (b"b", True)
    assert exact.probability == pytest.approx(0.45, abs=1e-12)
    assert certified is not None and certified.key == b"b"
