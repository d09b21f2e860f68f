"""The one interface an aggregator offers the :class:`~lm_eval_safe.ensemble.ensembler.Ensembler`
(docs/algorithm.md, Aggregators).

An aggregator ("method X" of the paper) turns the members' distributions at one ensemble point
into one chosen string. The Ensembler asks it everything that differs between aggregators and
nothing else: the choice from full rows, the choice from engine heads (or that the heads do
not settle it), which heads are too short to name its candidates, speculative sampling's
target distribution, the ensemble's strings a trace shows, and how much of the encoding of a
chosen string the drafter writes. The implementations (the paper's UniTE and GaC in
:mod:`lm_eval_safe.ensemble.aggregators`, the authors' in
:mod:`lm_eval_safe.ensemble.authors.aggregate`) are picked once, from the options, by
:func:`lm_eval_safe.ensemble.aggregators.make_aggregator`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from lm_eval_safe.ensemble.aggregate import Choice, View
from lm_eval_safe.errors import RequestError


class SampledTarget(NamedTuple):
    """Speculative sampling's two distributions at one point, over one list of slots.

    Slot ``i < len(keys)`` is the string ``keys[i]``; an aggregator may add slots past them that
    stand for strings it gives no probability (UniTE's one slot for every string outside its
    candidates). ``probs`` is P_ens per slot with the strings the drafter cannot write set to 0,
    not yet normalised (all 0: the members share no string the drafter can write); ``draft``
    is P_draft, the drafter's warped distribution summed per slot; ``drafted`` the slot of the
    drafted token."""

    keys: Sequence[bytes]
    probs: torch.Tensor  # float64
    draft: torch.Tensor  # float64
    drafted: int
    sharpened: bool


class Aggregator(ABC):
    """What the Ensembler asks at an ensemble point. Views are in member-slot order, the drafter
    first. A new aggregator implements :meth:`choose`, :meth:`candidates` and
    :meth:`written_ids`; the rest has a safe default (never certify from heads, never widen, no
    sampling), which an implementation overrides where it can do better."""

    @abstractmethod
    def choose(self, views: list[View]) -> Choice:
        """The chosen string from every member's full row (a greedy point). Where the rule that
        chose it also says how the drafter writes it, :attr:`Choice.drafter_ids` carries those
        ids and :meth:`written_ids` is not asked."""

    def choose_from_heads(self, views: list[View]) -> Choice | None:
        """The same string as :meth:`choose` from views where some rows are engine heads
        (:class:`~lm_eval_safe.engines.base.TopLogprobs`), or None where the heads do not settle
        it: the Ensembler then completes the rows and asks :meth:`choose`. The default never
        certifies, which is always correct and costs one Complete per head."""
        return None

    def short_heads(self, views: list[View]) -> list[int]:
        """The slots whose heads are too short for :meth:`choose_from_heads` to name the
        candidates from: the Ensembler widens them (one Complete with ``top`` each) and asks
        again before it completes the rows. Default: none."""
        return []

    def target(self, warped: list[View], drafted: int) -> SampledTarget:
        """Speculative sampling's P_ens and P_draft from the members' warped full rows, with the
        drafted token's slot. An aggregator with no sampled rule refuses here (the default);
        requests are refused before any work where the options say so
        (:func:`lm_eval_safe.decoder.loop.check_sampling`)."""
        raise RequestError(
            f"aggregator {type(self).__name__} has no sampled rule; decode greedily (do_sample=false) "
            "or choose an aggregator that samples"
        )

    @abstractmethod
    def candidates(self, views: list[View]) -> list[list[Any]]:
        """The ensemble's most probable strings at a point for traces, as
        :func:`~lm_eval_safe.ensemble.aggregate.top_candidates` lists them (full rows, warped
        when sampling)."""

    @abstractmethod
    def written_ids(self, encoded: list[int]) -> list[int]:
        """The drafter ids written for a chosen string the drafter has no single token for, from
        the drafter's encoding of its text (never empty)."""

    def prepare(self) -> None:
        """Lazy set-up done now (benchmarks keep it out of their timed loops). Default: none."""
        return None
