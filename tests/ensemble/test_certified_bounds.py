"""Certified decisions on cases built to sit on the bounds they rest on, against the exact rules.

Why: a decision taken from an engine's head (its ``K`` most probable ids and a few asked-about
ones) must be the one :func:`~lm_eval_safe.ensemble.aggregate.gac` / :func:`~lm_eval_safe.ensemble.aggregate.unite`
take on the whole distribution, or none at all. Random distributions (``test_certified.py``)
almost never put a value exactly where a bound is; these generators do: many ids at exactly the
K-th probability (an engine lists some of them, in its own order), a top-k place shared by
several ids, mass just outside the head, several ids spelling one string, float32 log-probs
whose probabilities sum past 1 (as an engine returns them), equal maxima within a member and
between strings of the mixture, a mixture maximum or a sharpening test exactly at its
threshold. Each case is decided from heads and on the float32 rows they were cut from; the
exact rules run on those rows, as the decoder runs them on a full distribution.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator

import pytest
import torch
from aggregate_cases import GreedyTokenizer, vocabulary

from lm_eval_safe.engines.base import TopLogprobs, row_probability_bounds
from lm_eval_safe.ensemble.aggregate import UnionVocabulary, View, gac, unite
from lm_eval_safe.ensemble.certified import (
    Interval,
    certified_consensus,
    certified_gac,
    certified_unite,
)
from lm_eval_safe.ensemble.consensus import consensus

#: Every member holds these, so a greedy longest match spells any string of POOL.
LETTERS = ["T", "h", "e", "n", " ", "t", "a", "c", "x", "y", "1", "2"]
POOL = ["The", "Th", "Then", " the", " th", " t", "ca", "cat", "an", "a ", "12", "x1", "yy"]

Case = tuple[list[View], list[View], int]  # full rows, heads cut from them, top_k


def _view(strings: list[str], probs: list[float], weight: float, round_up: bool = False) -> View:
    """A member over ``strings`` (a string may repeat: several ids spell it) with float32
    log-probs of ``probs``; ``round_up``: each rounded to the float32 above, so the
    probabilities sum past 1 as an engine's float32 log-softmax may."""
    vocab = vocabulary([s.encode("utf-8") for s in strings])
    logs = torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs], dtype=torch.float64)
    row = logs.float()
    if round_up:
        row = torch.where(row.double() < logs, torch.nextafter(row, torch.tensor(math.inf)), row)
    return View(row, vocab, GreedyTokenizer(strings), weight)


def _cut(view: View, k: int, rng: random.Random) -> View:
    """The row as an engine returns it: ``k`` ids of the highest values, equal values listed in
    any order and a tie at the k-th place filled by any of the tied ids, plus one asked-about id."""
    values = view.logprobs.tolist()
    order = list(range(len(values)))
    rng.shuffle(order)
    order.sort(key=lambda i: -values[i])  # stable: equal values keep the shuffled order
    top = order[: min(k, len(order))]
    known = {i: values[i] for i in top}
    asked = rng.randrange(len(values))
    known[asked] = values[asked]
    head = TopLogprobs(top, [values[i] for i in top], known)
    return View(head, view.vocab, view.tokenizer, view.weight)


def _strings(rng: random.Random, duplicates: int = 0) -> list[str]:
    strings = LETTERS + rng.sample(POOL, rng.randint(4, len(POOL)))
    strings += [rng.choice(strings) for _ in range(duplicates)]  # other ids of the same strings
    return strings


def _normalised(raw: list[float]) -> list[float]:
    total = sum(raw)
    return [r / total for r in raw]


def _ties_at_kth(rng: random.Random, n: int, k: int) -> list[float]:
    """A few clear leaders, then a group of equal values across the k-th place."""
    above = rng.randint(0, k - 1)
    raw = [rng.uniform(2.0, 6.0) for _ in range(above)]
    raw += [1.0] * rng.randint(k - above + 1, k - above + 5)
    raw += [rng.uniform(0.0, 0.9) for _ in range(max(0, n - len(raw)))]
    rng.shuffle(raw)
    return _normalised(raw[:n] if len(raw) > n else raw)


def _mass_outside(rng: random.Random, n: int, k: int) -> list[float]:
    """Leaders, then every other id at or a hair below the k-th value: the head's bound on an
    unknown id is attained and the unknown mass is nearly all that is left."""
    raw = [rng.uniform(1.0, 3.0) for _ in range(k)]
    kth = min(raw)
    raw += [kth * rng.choice([1.0, 1.0 - 1e-7, 1.0 - 1e-6, 0.999]) for _ in range(n - k)]
    rng.shuffle(raw)
    return _normalised(raw)


def _equal_maxima(rng: random.Random, n: int, k: int) -> list[float]:
    """Two or three ids share the largest value."""
    raw = [rng.uniform(0.0, 1.0) for _ in range(n)]
    for i in rng.sample(range(n), rng.randint(2, 3)):
        raw[i] = 2.0
    return _normalised(raw)


def _random_peaks(rng: random.Random, n: int, k: int) -> list[float]:
    scale = rng.choice([0.5, 2.0, 5.0])
    raw = [math.exp(rng.gauss(0.0, scale)) for _ in range(n)]
    return _normalised(raw)


SHAPES: dict[str, Callable[[random.Random, int, int], list[float]]] = {
    "ties_at_kth": _ties_at_kth,
    "mass_outside": _mass_outside,
    "equal_maxima": _equal_maxima,
    "random": _random_peaks,
}


def _cases(shape: str, seed: str, n: int) -> Iterator[Case]:
    """``n`` cases of one shape: 2-3 members (sometimes mirror images of each other, so that two
    strings tie in the mixture), heads of 3-10 ids, several ids per string in some members,
    float32 rows rounded up in some."""
    rng = random.Random(seed)
    for _ in range(n):
        k = rng.choice([3, 4, 5, 8, 10])
        top_k = rng.choice([t for t in (1, 2, 3, 5, 10) if t <= k])
        members = rng.choice([2, 2, 3])
        weights = [rng.choice([1.0, 1.0, 2.0, 0.5]) for _ in range(members)]
        full: list[View] = []
        first: tuple[list[str], list[float]] | None = None
        for m in range(members):
            if m == 1 and first is not None and rng.random() < 0.25:
                strings, probs = first[0], list(first[1])  # a mirror: two leaders swapped
                ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
                probs[ranked[0]], probs[ranked[1]] = probs[ranked[1]], probs[ranked[0]]
                weights[1] = weights[0]
            else:
                strings = _strings(rng, duplicates=rng.choice([0, 0, 2, 4]))
                probs = SHAPES[shape](rng, len(strings), k)
            first = first or (strings, probs)
            full.append(_view(strings, probs, weights[m], round_up=rng.random() < 0.3))
        yield full, [_cut(v, k, rng) for v in full], top_k


def _decide(aggregator: str, sharpen: str, full: list[View], heads: list[View], top_k: int):
    lam = 0.1
    if aggregator == "gac":
        union = UnionVocabulary.build([v.vocab for v in full])
        return gac(full, union, sharpen, lam, top_k), certified_gac(heads, union, sharpen, lam, top_k)
    return unite(full, sharpen, lam, top_k), certified_unite(heads, sharpen, lam, top_k)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("aggregator", ["gac", "unite"])
def test_certified_decisions_on_the_bounds_equal_the_exact_ones(aggregator: str, shape: str) -> None:
    """250 cases of a shape for each sharpening (6,000 over the parametrisation): every
    certified decision is the exact one; heads settle a good share of them."""
    certified = 0
    for sharpen in ("heuristic", "none", "geometric"):
        for trial, (full, heads, top_k) in enumerate(_cases(shape, f"{aggregator}/{shape}/{sharpen}", 250)):
            exact, got = _decide(aggregator, sharpen, full, heads, top_k)
            if got is None:
                continue
            certified += 1
            assert (got.key, got.sharpened) == (exact.key, exact.sharpened), (sharpen, trial)
    assert certified > 50, certified  # of 750 (ties at the k-th place settle fewest: about 100)


def _pinned(probs: list[float], own: int, value: float) -> list[float]:
    """``probs`` with ``own`` at ``value`` and the others scaled to the rest of the mass."""
    rest = sum(p for i, p in enumerate(probs) if i != own)
    return [value if i == own else p * (1.0 - value) / rest for i, p in enumerate(probs)]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_certified_consensus_on_the_bounds_equals_the_rule(shape: str) -> None:
    """SAFE's skip rule from heads (an own token known exactly, or bounded where the head does
    not name it) against the rule on the float32 rows: 400 cases with own tokens among equal
    maxima, at the k-th place or outside the head, a third of them with every own token at
    probability 0.5 (the weighted mean on the rule's threshold)."""
    rng = random.Random(shape)
    decided = 0
    for _ in range(400):
        k = rng.choice([3, 5, 10])
        pin = rng.random() < 0.3
        full, heads, owns = [], [], []
        for _ in range(rng.choice([2, 3])):
            strings = _strings(rng)
            probs = SHAPES[shape](rng, len(strings), k)
            ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
            own = rng.choice([ranked[0], ranked[min(k, len(ranked)) - 1], rng.randrange(len(probs))])
            if pin:
                probs = _pinned(probs, own, 0.5)
            view = _view(strings, probs, rng.choice([1.0, 2.0]), round_up=rng.random() < 0.3)
            full.append(view)
            heads.append(_cut(view, k, rng))
            owns.append(own)
        is_argmax = [int(torch.argmax(v.logprobs)) == o for v, o in zip(full[1:], owns[1:], strict=True)]
        weights = [v.weight for v in full]
        exact = consensus(is_argmax, [float(v.logprobs[o].exp()) for v, o in zip(full, owns, strict=True)], weights)
        bounds = [Interval(*row_probability_bounds(h.logprobs, o)) for h, o in zip(heads, owns, strict=True)]
        got = certified_consensus(is_argmax, bounds, weights)
        if got is not None:
            decided += 1
            assert got == exact
    assert decided > 100, decided


@pytest.mark.parametrize("aggregator", ["gac", "unite"])
def test_a_row_computed_again_decides_as_the_head_it_completes(aggregator: str) -> None:
    """An engine that answers a head in one request and its full row in another (vLLM, batched
    with other requests each time) gets two computations of one distribution, apart in their
    last bits or, on a GPU's half precision, by far more. Rows computed again (here: each
    log-prob moved by up to 1e-2, and some shifted as a renormalisation over other ids would shift
    it) decide otherwise than their heads in some cases; made consistent with the head
    (:func:`~lm_eval_safe.engines.base.consistent_row`) they decide as it does in every one."""
    from lm_eval_safe.engines.base import consistent_row

    rng = random.Random(aggregator)
    differ = certified = 0
    for sharpen in ("heuristic", "none", "geometric"):
        for full, heads, top_k in _cases("random", f"again/{aggregator}/{sharpen}", 200):
            again = []
            for view in full:
                noise = torch.tensor([rng.uniform(-1e-2, 1e-2) for _ in range(view.logprobs.numel())])
                shift = rng.choice([0.0, 0.0, 0.05])
                again.append(View(view.logprobs + noise + shift, view.vocab, view.tokenizer, view.weight))
            _, got = _decide(aggregator, sharpen, full, heads, top_k)
            if got is None:
                continue
            certified += 1
            raw, _ = _decide(aggregator, sharpen, again, heads, top_k)
            differ += int((raw.key, raw.sharpened) != (got.key, got.sharpened))
            made = [
                View(consistent_row(v.logprobs.float(), h.logprobs), v.vocab, v.tokenizer, v.weight)
                for v, h in zip(again, heads, strict=True)
            ]
            exact, _ = _decide(aggregator, sharpen, made, heads, top_k)
            assert (exact.key, exact.sharpened) == (got.key, got.sharpened), sharpen
    assert certified > 100 and differ > 0, (certified, differ)
