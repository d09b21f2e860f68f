"""The paper's UniTE and GaC behind the :class:`~lm_eval_safe.ensemble.aggregator.Aggregator`
interface, and the one place an aggregator is picked from the options (:func:`make_aggregator`).

The arithmetic is :mod:`lm_eval_safe.ensemble.aggregate`'s (full rows, and as distributions for
sampling) and :mod:`lm_eval_safe.ensemble.certified`'s (engine heads); these classes say which
of it an aggregator reads and how its strings map onto the drafter's (docs/algorithm.md,
Aggregators; README "Sampling").
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch

from lm_eval_safe.disk_cache import cache_root
from lm_eval_safe.engines.spec import head_width
from lm_eval_safe.ensemble.aggregate import (
    Choice,
    UnionVocabulary,
    View,
    gac,
    gac_distribution,
    top_candidates,
    unite,
    unite_distribution,
)
from lm_eval_safe.ensemble.aggregator import Aggregator, SampledTarget
from lm_eval_safe.ensemble.authors.aggregate import AuthorsGac, AuthorsUnite
from lm_eval_safe.ensemble.certified import as_head, certified_gac, certified_unite, short_heads
from lm_eval_safe.ensemble.writing import can_write
from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.member import Member
from lm_eval_safe.options import SafeOptions


class _Paper(Aggregator):
    """What the paper's two aggregators share: sharpening's settings, and the width a full row
    is cut to when it decides beside engine heads (``engines=hf,vllm``)."""

    def __init__(self, drafter: Member, verifiers: list[Member], options: SafeOptions):
        self.drafter = drafter
        self.sharpen, self.lam, self.top_k = options.sharpen, options.sharpen_lambda, options.top_k
        self.head_width = head_width(options.top_logprobs, options.top_k)

    def _heads(self, views: list[View]) -> list[View]:
        return [as_head(v, self.head_width) for v in views]


class Unite(_Paper):
    """UniTE: each member's softmax over the union of the members' top-k strings, averaged. A
    chosen string the drafter has no token for is written as the first id of its encoding."""

    def choose(self, views: list[View]) -> Choice:
        return unite(views, self.sharpen, self.lam, self.top_k)

    def choose_from_heads(self, views: list[View]) -> Choice | None:
        return certified_unite(self._heads(views), self.sharpen, self.lam, self.top_k)

    def short_heads(self, views: list[View]) -> list[int]:
        return short_heads(views, self.top_k)

    def target(self, warped: list[View], drafted: int) -> SampledTarget:
        """UniTE's strings, then one slot for every other string (P_ens is 0 there); several
        drafter ids may spell one string, so P_draft sums them."""
        drafter_probs = warped[0].logprobs.exp()
        target = unite_distribution(warped, self.sharpen, self.lam, self.top_k)
        ids_of = self.drafter.vocab.ids_of
        draft = torch.tensor(
            [float(drafter_probs[list(ids_of.get(key, ()))].sum()) for key in target.keys] + [0.0],
            dtype=torch.float64,
        )
        draft[-1] = max(0.0, 1.0 - float(draft.sum()))
        key = self.drafter.vocab.keys[drafted]
        drafted_index = target.keys.index(key) if key in target.keys else len(target.keys)
        sayable = [can_write(self.drafter, k) for k in target.keys] + [False]
        probs = torch.cat([target.probs, torch.zeros(1, dtype=torch.float64)])
        probs = probs * torch.tensor(sayable, dtype=torch.float64)
        return SampledTarget(target.keys, probs, draft, drafted_index, target.sharpened)

    def candidates(self, views: list[View]) -> list[list[Any]]:
        target = unite_distribution(views, self.sharpen, self.lam, self.top_k)
        return top_candidates(target.keys, target.probs)

    def written_ids(self, encoded: list[int]) -> list[int]:
        return encoded[:1]


class Gac(_Paper):
    """GaC: the members' full distributions averaged over the union of their vocabularies. A
    chosen string the drafter has no token for is written as its whole encoding."""

    def __init__(self, drafter: Member, verifiers: list[Member], options: SafeOptions):
        super().__init__(drafter, verifiers, options)
        self._vocabs = [drafter.vocab] + [v.vocab for v in verifiers]
        self._cache_dir = options.cache_dir

    @cached_property
    def union(self) -> UnionVocabulary:
        """The union vocabulary, built (or read from its disk cache) on first use."""
        return UnionVocabulary.build(self._vocabs, cache_root(self._cache_dir))

    def prepare(self) -> None:
        _ = self.union

    def choose(self, views: list[View]) -> Choice:
        return gac(views, self.union, self.sharpen, self.lam, self.top_k)

    def choose_from_heads(self, views: list[View]) -> Choice | None:
        return certified_gac(self._heads(views), self.union, self.sharpen, self.lam, self.top_k)

    def short_heads(self, views: list[View]) -> list[int]:
        """Only heuristic sharpening reads GaC's top-k strings."""
        return short_heads(views, self.top_k) if self.sharpen == "heuristic" else []

    def target(self, warped: list[View], drafted: int) -> SampledTarget:
        """Over the union: P_draft is the drafter's row summed into it."""
        drafter_probs = warped[0].logprobs.exp()
        target = gac_distribution(warped, self.union, self.sharpen, self.lam, self.top_k)
        mapping = self.union.maps[0]
        draft = torch.zeros(len(self.union), dtype=torch.float64)
        draft.scatter_add_(0, mapping, drafter_probs)
        probs = target.probs * self._sayable
        return SampledTarget(target.keys, probs, draft, int(mapping[drafted]), target.sharpened)

    @cached_property
    def _sayable(self) -> torch.Tensor:
        """1.0 for each union string the drafter can write, else 0.0."""
        return torch.tensor([can_write(self.drafter, key) for key in self.union.keys], dtype=torch.float64)

    def candidates(self, views: list[View]) -> list[list[Any]]:
        target = gac_distribution(views, self.union, self.sharpen, self.lam, self.top_k)
        return top_candidates(target.keys, target.probs)

    def written_ids(self, encoded: list[int]) -> list[int]:
        return encoded


#: Builds an aggregator from the drafter, the verifiers and the options.
AggregatorFactory = Callable[[Member, list[Member], SafeOptions], Aggregator]

#: ``(reference, aggregator)`` option values -> what decides there. A new aggregator is one
#: class behind :class:`~lm_eval_safe.ensemble.aggregator.Aggregator` and one entry here (its
#: name also among :data:`lm_eval_safe.options.AGGREGATORS` for model_args to accept it).
AGGREGATORS: dict[tuple[str, str], AggregatorFactory] = {
    ("paper", "unite"): Unite,
    ("paper", "gac"): Gac,
    ("authors", "unite"): AuthorsUnite.from_options,
    ("authors", "gac"): AuthorsGac.from_options,
}


def make_aggregator(drafter: Member, verifiers: list[Member], options: SafeOptions) -> Aggregator:
    """The aggregator the options name, built once per decoder. A decoder without verifiers
    never ensembles, and the authors' code needs its one verifier, so it gets the paper's."""
    reference = options.reference if verifiers else "paper"
    factory = AGGREGATORS.get((reference, options.aggregator))
    if factory is None:
        known = ", ".join(sorted(name for ref, name in AGGREGATORS if ref == reference))
        raise OptionError(
            f"aggregator={options.aggregator} has no reference={reference} implementation; use one of {known}"
        )
    return factory(drafter, verifiers, options)
