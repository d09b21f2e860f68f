"""Aggregators (GaC, UniTE) and probability sharpening on hand-computed distributions.

Why these tests: at an ensemble point the aggregate decides the next token, so an error here
(a weight ignored, a missing string scored as zero instead of through its first token,
sharpening absorbing already-sharpened mass) changes outputs without any crash. Each case
uses tiny made-up vocabularies whose numbers can be checked on paper (docs/algorithm.md, Aggregators and Sharpening); the
expected values are written out here or computed by a small reference written for the test,
never taken from the code under test.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from aggregate_cases import (
    EOS,
    POOL,
    assert_choice,
    member,
    random_members,
    run,
    table_of,
)
from transformers import AutoTokenizer

from lm_eval_safe.ensemble.aggregate import View, unite
from lm_eval_safe.members.vocabulary import TokenVocabulary

A_TABLE = {"The": 0.4, " Th": 0.3, "A": 0.2, "x": 0.1}
B_TABLE = {"A": 0.5, "The": 0.25, "y": 0.25}


def test_gac_plain_average() -> None:
    """Union entries average the members' probabilities, missing strings counting as 0.

    By hand: The = (0.4 + 0.25)/2 = 0.325, A = (0.2 + 0.5)/2 = 0.35, " Th" = 0.15,
    y = 0.125, x = 0.05. "A" wins although it is only member A's third choice.
    """
    assert_choice(run("gac", [member(A_TABLE), member(B_TABLE)]), "A", 0.35, False)


@pytest.mark.parametrize(
    ("weights", "key", "probability"),
    [
        ((3.0, 1.0), "The", 0.75 * 0.4 + 0.25 * 0.25),  # A: 0.75*0.2 + 0.25*0.5 = 0.275
        ((1.0, 3.0), "A", 0.25 * 0.2 + 0.75 * 0.5),  # The: 0.25*0.4 + 0.75*0.25 = 0.2875
        ((2.0, 2.0), "A", 0.35),  # only the ratio matters
    ],
)
def test_gac_weights(weights: tuple[float, float], key: str, probability: float) -> None:
    """Member weights are normalised to sum to 1 and scale each member's contribution.

    Why: ``weights=`` is a user option; weighting the stronger model must move the argmax.
    """
    views = [member(A_TABLE, weights[0]), member(B_TABLE, weights[1])]
    assert_choice(run("gac", views), key, probability, False)


def test_gac_and_unite_merge_eos_of_different_members() -> None:
    """Each member's own EOS token lands on one entry, so their stop mass adds up.

    By hand: EOS = (0.6 + 0.7)/2 = 0.65 in both aggregators (UniTE's union with k=2 is
    {EOS, x, y}, which is each member's whole vocabulary).
    """
    a = {"x": 0.3, EOS: 0.6, "y": 0.1}
    b = {EOS: 0.7, "y": 0.2, "x": 0.1}
    for method in ("gac", "unite"):
        assert_choice(run(method, [member(a), member(b)], k=2), EOS, 0.65, False)


# --------------------------------------------------------------------------------------
# UniTE: softmax over the union of top-k strings
# --------------------------------------------------------------------------------------

# Member A ranks The, A first; member B ranks B, Th first. With k = 2 the union is
# [The, A, B, Th]. B has no "The": it uses its first token of "The", which is "Th" (0.3).
U_A = {"The": 0.45, "A": 0.2, "Th": 0.1, "T": 0.05, "h": 0.05, "e": 0.05, "B": 0.05, "x": 0.05}
U_B = {"B": 0.4, "Th": 0.3, "A": 0.1, "T": 0.05, "h": 0.05, "e": 0.05, "x": 0.05}
Q_A = {"The": 0.45 / 0.8, "A": 0.2 / 0.8, "B": 0.05 / 0.8, "Th": 0.1 / 0.8}
Q_B = {"The": 0.3 / 1.1, "A": 0.1 / 1.1, "B": 0.4 / 1.1, "Th": 0.3 / 1.1}


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0), (3.0, 1.0)])
def test_unite_average_over_union_of_top_k(weights: tuple[float, float]) -> None:
    """Each member renormalises over the union of top-k strings; then a weighted average.

    Why: UniTE differs from GaC in exactly these two points (only top-k strings, and a
    member's probability of a string it lacks is that of its first token); scoring the
    missing "The" as 0 for B would give The = 0.28 instead of 0.418 with equal weights.
    """
    wa, wb = (w / sum(weights) for w in weights)
    expected = {s: wa * Q_A[s] + wb * Q_B[s] for s in Q_A}
    key = max(expected, key=lambda s: expected[s])
    assert key == "The"
    views = [member(U_A, weights[0]), member(U_B, weights[1])]
    assert_choice(run("unite", views, k=2), key, expected[key], False)


def test_unite_geometric() -> None:
    """Geometric UniTE: weighted log-mean of the members' renormalised union probabilities."""
    expected = {s: math.sqrt(Q_A[s] * Q_B[s]) for s in Q_A}
    assert max(expected, key=lambda s: expected[s]) == "The"
    assert max(0.5 * Q_A[s] + 0.5 * Q_B[s] for s in Q_A) < 0.5  # smooth: sharpened
    views = [member(U_A), member(U_B)]
    assert_choice(run("unite", views, "geometric", k=2), "The", expected["The"], True)


def test_unite_reads_the_piece_not_the_byte_fallback_token(tiny_sp_dir: Path) -> None:
    """A SentencePiece member is scored through the piece its model predicts.

    Why: such vocabularies hold "A" twice (``<0x41>`` and the piece ``A``). With logits 10 for
    the piece ``A``, 9 for ``▁the`` and -10 for ``<0x41>``, the top-2 union is {A, " the"} and
    A = 1/(1 + e^-1). Reading the byte token instead would make " the" win with ~1.
    """
    tok = AutoTokenizer.from_pretrained(tiny_sp_dir)
    vocab = TokenVocabulary.for_tokenizer(tok)
    piece, space_the, byte = tok.convert_tokens_to_ids(["A", "▁the", "<0x41>"])
    assert len({piece, space_the, byte, tok.unk_token_id}) == 4
    logits = torch.zeros(len(vocab))
    logits[piece], logits[space_the], logits[byte] = 10.0, 9.0, -10.0
    view = View(torch.log_softmax(logits, dim=-1), vocab, tok)
    assert_choice(unite([view], "none", 0.1, 2), "A", 1 / (1 + math.exp(-1)), False)


# --------------------------------------------------------------------------------------
# Heuristic sharpening
# --------------------------------------------------------------------------------------


def _two_members_averaging_to(agg: dict[str, float]) -> list[View]:
    """Two members, different from each other, whose plain average is ``agg``.

    Member A moves 0.05 of the largest string's mass to the smallest; B the opposite.
    """
    hi = max(agg, key=lambda s: agg[s])
    lo = min(agg, key=lambda s: agg[s])
    a = dict(agg)
    b = dict(agg)
    a[hi], a[lo] = agg[hi] - 0.05, agg[lo] + 0.05
    b[hi], b[lo] = agg[hi] + 0.05, agg[lo] - 0.05
    return [member(a), member(b)]


AGGREGATORS = ["gac", "unite"]


@pytest.mark.parametrize("method", AGGREGATORS)
def test_sharpening_absorbs_strings_it_prefixes(method: str) -> None:
    """The spec's example: "The" absorbs "Then" and "They" and beats "A".

    Aggregate The 0.3, Then 0.25, They 0.1, A 0.35 (max < 0.5): The -> 0.3 + 0.25 + 0.1
    = 0.65. Without sharpening A wins with 0.35.
    """
    agg = {"The": 0.3, "Then": 0.25, "They": 0.1, "A": 0.35}
    views = _two_members_averaging_to(agg)
    assert_choice(run(method, views, "none"), "A", 0.35, False)
    assert_choice(run(method, views, "heuristic"), "The", 0.65, True)


@pytest.mark.parametrize("method", AGGREGATORS)
def test_sharpening_uses_pre_sharpening_probabilities(method: str) -> None:
    """Each string absorbs the *original* mass of the strings it prefixes.

    Th 0.2, The 0.3, Then 0.15, A 0.35: Th = 0.2 + 0.3 + 0.15 = 0.65 (not 0.2 + 0.45 +
    0.15 = 0.8, which adding The's already sharpened 0.45 would give); The = 0.45.
    """
    agg = {"Th": 0.2, "The": 0.3, "Then": 0.15, "A": 0.35}
    assert_choice(run(method, [member(agg), member(agg)], "heuristic"), "Th", 0.65, True)


@pytest.mark.parametrize("method", AGGREGATORS)
@pytest.mark.parametrize("blank", [" ", "\n"])
def test_whitespace_never_absorbs(method: str, blank: str) -> None:
    """A whitespace-only string would prefix every word after it: it must not absorb.

    " " 0.3 prefixes " the" 0.25 and " a" 0.1; absorbing would give 0.65 > A's 0.35.
    """
    agg = {blank: 0.3, blank + "the": 0.25, blank + "a": 0.1, "A": 0.35}
    views = _two_members_averaging_to(agg)
    assert_choice(run(method, views, "heuristic"), "A", 0.35, False)


@pytest.mark.parametrize("method", AGGREGATORS)
def test_sharpening_only_below_one_half(method: str) -> None:
    """A maximum of 0.5 is a decision; 0.49 is smeared and gets sharpened.

    A 0.5, The 0.3, Then 0.2 -> A stays (The would only reach a tie at 0.5).
    A 0.49, The 0.3, Then 0.21 -> The = 0.51 wins.
    """
    decided = {"A": 0.5, "The": 0.3, "Then": 0.2}
    assert_choice(run(method, [member(decided)] * 2, "heuristic"), "A", 0.5, False)
    smeared = {"A": 0.49, "The": 0.3, "Then": 0.21}
    assert_choice(run(method, [member(smeared)] * 2, "heuristic"), "The", 0.51, True)


@pytest.mark.parametrize("method", AGGREGATORS)
def test_sharpening_lambda(method: str) -> None:
    """Only a string with aggregate probability above lambda absorbs.

    The 0.12 would absorb Then 0.27 and They 0.26 (-> 0.65): with lambda 0.15 it may not
    (A wins with 0.35), with lambda 0.1 it does.
    """
    agg = {"The": 0.12, "Then": 0.27, "They": 0.26, "A": 0.35}
    views = _two_members_averaging_to(agg)
    assert_choice(run(method, views, "heuristic", lam=0.15), "A", 0.35, False)
    assert_choice(run(method, views, "heuristic", lam=0.1), "The", 0.65, True)


def test_sharpening_needs_the_drafters_top_k_and_candidates() -> None:
    """Absorbers come from the drafter's top-k; absorbed strings from all members' top-k.

    Drafter: A 0.4, Then 0.35, The 0.15, They 0.1. Verifier: A 0.3, The 0.45, Then 0.15,
    They 0.1. Aggregate: A 0.35, The 0.3, Then 0.25, They 0.1.
    k=2: The is not in the drafter's top 2 -> A 0.35.
    k=3: The absorbs Then (They is no one's top 3) -> 0.55. k=4: -> 0.65.
    With the roles swapped, The is in the new drafter's top 2 -> 0.3 + 0.25 = 0.55.
    """
    drafter = member({"A": 0.4, "Then": 0.35, "The": 0.15, "They": 0.1})
    verifier = member({"A": 0.3, "The": 0.45, "Then": 0.15, "They": 0.1})
    assert_choice(run("gac", [drafter, verifier], "heuristic", k=2), "A", 0.35, False)
    assert_choice(run("gac", [drafter, verifier], "heuristic", k=3), "The", 0.55, True)
    assert_choice(run("gac", [drafter, verifier], "heuristic", k=4), "The", 0.65, True)
    assert_choice(run("gac", [verifier, drafter], "heuristic", k=2), "The", 0.55, True)


# --------------------------------------------------------------------------------------
# Random checks against a reference, and Theorem 1
# --------------------------------------------------------------------------------------

def _reference_gac(views: list[View]) -> dict[str, float]:
    weights = [v.weight / sum(w.weight for w in views) for v in views]
    out: dict[str, float] = {}
    for view, w in zip(views, weights, strict=True):
        for s, p in table_of(view).items():
            out[s] = out.get(s, 0.0) + w * p
    return out


def _reference_unite(views: list[View], k: int) -> dict[str, float]:
    weights = [v.weight / sum(w.weight for w in views) for v in views]
    union: list[str] = []
    for view in views:
        table = table_of(view)
        for s in sorted(table, key=lambda s: -table[s])[:k]:
            if s not in union:
                union.append(s)
    out = dict.fromkeys(union, 0.0)
    for view, w in zip(views, weights, strict=True):
        table = table_of(view)
        own = {}
        for s in union:  # a lacking string: greedy longest match gives the first token
            first = s if s in table else max((t for t in table if s.startswith(t)), key=len)
            own[s] = table[first]
        total = sum(own.values())
        for s in union:
            out[s] += w * own[s] / total
    return out


def test_random_distributions_match_reference() -> None:
    """GaC and UniTE (k=3) agree with straightforward reference implementations."""
    rng = random.Random(1234)
    for _ in range(60):
        views = random_members(rng, None)
        for method, ref in (("gac", _reference_gac(views)), ("unite", _reference_unite(views, 3))):
            best = max(ref, key=lambda s: ref[s])
            assert_choice(run(method, views, k=3), best, ref[best], False)


@pytest.mark.parametrize("method", AGGREGATORS)
def test_theorem_1_common_argmax_wins(method: str) -> None:
    """If every member's argmax is the same string, the plain average picks it (Theorem 1).

    Why: SAFE skips ensembling at consensus positions on the strength of this theorem; the
    aggregators must not break it (e.g. by letting a member's duplicated or missing strings
    outweigh its own top choice).
    """
    rng = random.Random(7)
    for trial in range(100):
        winner = rng.choice(POOL[3:])
        views = random_members(rng, winner)
        choice = run(method, views, "none", k=rng.randint(1, 5))
        assert choice.key == winner.encode("utf-8"), (trial, winner, choice)
