"""Hand-made members for the aggregator tests: tiny vocabularies whose numbers can be checked
on paper (a view per member, built from a table of string probabilities), and random members
over a small pool of strings that prefix each other, for the tests that compare the aggregators
with references written for them (tests/ensemble/)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lm_eval_safe.ensemble.aggregate import Choice, UnionVocabulary, View, gac, unite
from lm_eval_safe.members.vocabulary import EOS_KEY, TokenVocabulary

EOS = "<eos>"  # marks a member's EOS token in the tables below


class GreedyTokenizer:
    """Longest-match tokenizer over a member's strings: all ``encode_text`` needs of one.

    UniTE scores a string a member lacks by the member's first token of that string, so the
    fake members need a real (if simple) tokenization that the tests can follow by hand.
    """

    def __init__(self, strings: list[str]):
        self.strings = strings

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, pos = [], 0
        while pos < len(text):
            fits = [i for i, s in enumerate(self.strings) if s != EOS and text.startswith(s, pos)]
            if not fits:
                raise ValueError(f"cannot tokenize {text[pos:]!r}")
            best = max(fits, key=lambda i: len(self.strings[i]))
            ids.append(best)
            pos += len(self.strings[best])
        return ids


def vocabulary(keys: list[bytes], text: list[bytes] | None = None, eos: frozenset[int] = frozenset()) -> TokenVocabulary:
    """A made-up member's vocabulary: id i is ``keys[i]`` (a key may repeat: several ids spell
    one string; the first is the one ``lookup`` names), spelling ``text[i]`` (default: the key)."""
    lookup: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        lookup.setdefault(key, i)
    return TokenVocabulary(
        text_bytes=list(keys) if text is None else text,
        keys=keys,
        special_ids=eos,
        eos_ids=eos,
        adds_prefix_space=False,
        lookup=lookup,
        fingerprint="fake-" + repr(keys),
    )


def member(table: dict[str, float], weight: float = 1.0) -> View:
    """A member whose vocabulary is ``table``'s strings, with exactly those probabilities."""
    strings = list(table)
    keys = [EOS_KEY if s == EOS else s.encode("utf-8") for s in strings]
    text = [b"" if s == EOS else s.encode("utf-8") for s in strings]
    eos = frozenset(i for i, s in enumerate(strings) if s == EOS)
    vocab = vocabulary(keys, text, eos)
    probs = torch.tensor([table[s] for s in strings], dtype=torch.float64)
    assert abs(float(probs.sum()) - 1.0) < 1e-9, table
    return View(probs.log(), vocab, GreedyTokenizer(strings), weight)


def run(method: str, views: list[View], sharpen: str = "none", lam: float = 0.1, k: int = 10):
    """One aggregation with ``method`` ("gac" builds its union vocabulary first)."""
    if method == "gac":
        union = UnionVocabulary.build([v.vocab for v in views])
        return gac(views, union, sharpen, lam, k)
    return unite(views, sharpen, lam, k)


def assert_choice(choice: Choice, key: str, probability: float, sharpened: bool) -> None:
    expected_key = EOS_KEY if key == EOS else key.encode("utf-8")
    assert choice.key == expected_key, (choice, key)
    assert choice.probability == pytest.approx(probability, abs=1e-9), (choice, probability)
    assert choice.sharpened is sharpened, choice



POOL = ["a", "b", "c", "ab", "ba", "abc", "ca", "cab", "bb", "aab", " a", " ", "cc"]


def random_members(rng: random.Random, winner: str | None) -> list[View]:
    """2-3 members over random sub-vocabularies of POOL (all hold the single letters).

    If ``winner`` is given, it is every member's most probable string.
    """
    views = []
    for _ in range(rng.randint(2, 3)):
        strings = sorted(
            {"a", "b", "c", " "}
            | set(rng.sample(POOL, rng.randint(3, len(POOL))))
            | ({winner} if winner else set())
        )
        raw = [rng.expovariate(1.0) for _ in strings]
        if winner:
            raw[strings.index(winner)] = max(raw) * (1.05 + rng.random())
        total = sum(raw)
        views.append(
            member(
                {s: r / total for s, r in zip(strings, raw, strict=True)},
                weight=rng.uniform(0.2, 3.0),
            )
        )
    return views


def table_of(view: View) -> dict[str, float]:
    return {
        s: math.exp(float(lp))
        for s, lp in zip(view.tokenizer.strings, view.logprobs.tolist(), strict=True)
    }
