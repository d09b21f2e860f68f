"""Geometric sharpening as the paper and its authors apply it: where the mixture's maximum is
below 0.5, the weighted geometric mean of the members' probabilities decides instead; a decided
mixture stands. Hand-computed cases and random members of both regimes against the rule written
out by hand (the members and helpers of tests/ensemble/test_aggregate.py)."""

from __future__ import annotations

import math
import random

import pytest
from aggregate_cases import assert_choice, member, random_members, run, table_of

from lm_eval_safe.ensemble.aggregate import View


def test_gac_geometric_is_weighted_log_mean_over_shared_strings() -> None:
    """Geometric sharpening: below 0.5, exp(sum_m w_m log p_m); a string one member lacks
    cannot win.

    By hand: arithmetic mean picks X (0.8/2 = 0.4 > Y's 0.375), but X is absent from B.
    Geometric: Y = sqrt(0.15 * 0.6) = 0.3, Z = sqrt(0.05 * 0.4) = 0.141 -> Y with 0.3.
    With weights 1:3 the mixture is still smooth (Y = 0.25*0.15 + 0.75*0.6 = 0.4875) and
    Y = 0.15^0.25 * 0.6^0.75 wins the geometric mean.
    """
    a = {"X": 0.8, "Y": 0.15, "Z": 0.05}
    b = {"Y": 0.6, "Z": 0.4}
    assert_choice(run("gac", [member(a), member(b)]), "X", 0.4, False)
    assert_choice(run("gac", [member(a), member(b)], "geometric"), "Y", 0.3, True)
    weighted = [member(a, 1.0), member(b, 3.0)]
    assert_choice(run("gac", weighted, "geometric"), "Y", 0.15**0.25 * 0.6**0.75, True)


@pytest.mark.parametrize("method", ["gac", "unite"])
def test_geometric_sharpening_only_below_one_half(method: str) -> None:
    """The paper applies the geometric mean as a sharpening: only where the mixture is smooth.

    By hand, weights 3:1 (UniTE's union of top-3 strings is every string, so its tables are the
    members' own): X = 0.75*0.7 + 0.25*0.01 = 0.5275 decides the mixture; the geometric mean
    would pick Y (0.25^0.75 * 0.6^0.25 = 0.3112 against X's 0.7^0.75 * 0.01^0.25 = 0.2420), so
    applying it at every point would replace a decided string. With equal weights the
    mixture is smooth (X = 0.355) and the geometric mean decides: Y = sqrt(0.25 * 0.6).
    """
    a = {"X": 0.7, "Y": 0.25, "Z": 0.05}
    b = {"Y": 0.6, "Z": 0.39, "X": 0.01}
    weighted = [member(a, 3.0), member(b, 1.0)]
    assert_choice(run(method, weighted, "geometric", k=3), "X", 0.5275, False)
    assert_choice(run(method, weighted, "none", k=3), "X", 0.5275, False)
    equal = [member(a), member(b)]
    assert_choice(run(method, equal, "geometric", k=3), "Y", math.sqrt(0.25 * 0.6), True)


def _reference_geometric(tables: list[dict[str, float]], weights: list[float]) -> tuple[str, float, bool]:
    """The paper's geometric sharpening by hand: the weighted mixture's argmax, unless its
    maximum is below 0.5; then the argmax of prod_m p_m(s)^w_m over the strings every member
    of positive weight gives probability."""
    total = sum(weights)
    w = [x / total for x in weights]
    strings = {s for t in tables for s in t}
    mixture = {s: sum(wm * t.get(s, 0.0) for wm, t in zip(w, tables, strict=True)) for s in strings}
    best = max(mixture, key=lambda s: mixture[s])
    if mixture[best] >= 0.5:
        return best, mixture[best], False
    used = [(wm, t) for wm, t in zip(w, tables, strict=True) if wm > 0]
    shared = [s for s in strings if all(t.get(s, 0.0) > 0 for _, t in used)]
    geometric = {s: math.prod(t[s] ** wm for wm, t in used) for s in shared}
    best = max(geometric, key=lambda s: geometric[s])
    return best, geometric[best], True


def _unite_tables(views: list[View], k: int) -> list[dict[str, float]]:
    """Each member's softmax over the union of the members' top-k strings (a lacking string
    through its first token), by hand."""
    union: list[str] = []
    for view in views:
        table = table_of(view)
        union += [s for s in sorted(table, key=lambda s: -table[s])[:k] if s not in union]
    tables = []
    for view in views:
        table = table_of(view)
        own = {s: table[s if s in table else max((t for t in table if s.startswith(t)), key=len)] for s in union}
        tables.append({s: p / sum(own.values()) for s, p in own.items()})
    return tables


def _leaning(table: dict[str, float], string: str, extra: float) -> dict[str, float]:
    """``table`` with ``extra`` times its mass added to ``string``, renormalised."""
    raised = {s: p + (extra if s == string else 0.0) for s, p in table.items()}
    total = sum(raised.values())
    return {s: p / total for s, p in raised.items()}


def test_random_geometric_sharpening_matches_reference() -> None:
    """GaC and UniTE (k=3) with ``sharpen=geometric`` against the rule by hand, on members of
    random weights: both regimes occur, and so do decided mixtures whose geometric mean ranks
    another string first (where the mean applied at every point would change the choice)."""
    rng = random.Random(4321)
    regimes = {True: 0, False: 0}
    decided_but_geometric_differs = 0
    for _ in range(200):
        views = random_members(rng, None)
        if rng.random() < 0.6:
            # a heavy member leans towards one string and a little towards a second, the others
            # towards the second: often a mixture the heavy member decides for a string the
            # others barely give, while the geometric mean prefers the shared second string
            own, shared = rng.sample("abc", 2)
            heavy, *rest = views
            leaned = _leaning(_leaning(table_of(heavy), own, rng.uniform(1.0, 4.0)), shared, rng.uniform(0.0, 1.5))
            views = [member(leaned, rng.uniform(1.5, 4.0) * sum(v.weight for v in rest))] + [
                member(_leaning(table_of(v), shared, rng.uniform(0.5, 3.0)), v.weight) for v in rest
            ]
        weights = [v.weight for v in views]
        for method in ("gac", "unite"):
            tables = [table_of(v) for v in views] if method == "gac" else _unite_tables(views, 3)
            key, probability, sharpened = _reference_geometric(tables, weights)
            assert_choice(run(method, views, "geometric", k=3), key, probability, sharpened)
            regimes[sharpened] += 1
            if not sharpened:  # what the geometric mean at every point would have chosen
                w = [x / sum(weights) for x in weights]
                shared = [s for s in tables[0] if all(t.get(s, 0.0) > 0 for t in tables)]
                geometric = {s: math.prod(t[s] ** wm for wm, t in zip(w, tables, strict=True)) for s in shared}
                decided_but_geometric_differs += int(max(geometric, key=lambda s: geometric[s]) != key)
    assert min(regimes.values()) > 40, regimes
    assert decided_but_geometric_differs >= 3, decided_but_geometric_differs
