"""What happens at an ensemble point (docs/algorithm.md, Aggregators): the aggregate's choice (greedy)
or speculative sampling's keep-or-replace (README "Sampling"), and the chosen string as the
drafter's ids.

The aggregators themselves sit behind one interface (:mod:`lm_eval_safe.ensemble.aggregator`,
picked once by :func:`~lm_eval_safe.ensemble.aggregators.make_aggregator`); this module asks them
for one drafter, which is what decides which strings can be written, and owns the engine calls
(:class:`~lm_eval_safe.engines.base.Complete`) a decision needs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from lm_eval_safe.engines.base import Complete, is_full
from lm_eval_safe.engines.spec import head_width
from lm_eval_safe.ensemble.aggregate import Choice, View, top_candidates
from lm_eval_safe.ensemble.aggregators import make_aggregator
from lm_eval_safe.ensemble.sampling import RowSampler
from lm_eval_safe.ensemble.writing import ENCODE, EOS, KEEP_DRAFTED, TOKEN, route
from lm_eval_safe.members.member import Member
from lm_eval_safe.options import SafeOptions


def complete_views(views: list[View]) -> Any:
    """Steps returning ``views`` with every engine head replaced by its full distribution (one
    :class:`~lm_eval_safe.engines.base.Complete` call per member that answered with a head).
    Views are in member-slot order (the drafter first), as every schedule builds them. The
    schedules call it themselves where their consensus gate needs full rows: the gate is the
    schedule's rule, the same for every aggregator, and the Ensembler then finds those points
    full and asks the engines nothing more."""
    completed = list(views)
    for slot, view in enumerate(views):
        if not is_full(view.logprobs):
            (full,) = yield Complete(slot, [view.logprobs])
            completed[slot] = View(full, view.vocab, view.tokenizer, view.weight)
    return completed


def widen_views(views: list[View], slots: list[int], top: int) -> Any:
    """Steps returning ``views`` with the heads at ``slots`` widened to ``top`` ids (one
    :class:`~lm_eval_safe.engines.base.Complete` call with ``top`` per member)."""
    widened = list(views)
    for slot in slots:
        view = views[slot]
        (head,) = yield Complete(slot, [view.logprobs], top=top)
        widened[slot] = View(head, view.vocab, view.tokenizer, view.weight)
    return widened


class Decision(NamedTuple):
    """One ensemble point's outcome: the choice, the views it was taken on (completed where the
    heads did not settle it or a trace needs the full rows) and speculative sampling's test for a
    traced sampled point; ``certified`` says whether engine heads settled it (None: full rows
    all along)."""

    choice: Choice
    views: list[View]
    test: dict[str, float] | None
    certified: bool | None


class Ensembler:
    """The ensemble decisions of one decoder: its aggregator over the drafter and verifiers."""

    def __init__(self, drafter: Member, verifiers: list[Member], options: SafeOptions):
        self.drafter = drafter
        self.verifiers = verifiers
        self.options = options
        self.aggregator = make_aggregator(drafter, verifiers, options)

    # -- greedy -----------------------------------------------------------------------------
    def choose(self, views: list[View]) -> Choice | None:
        """The aggregate's argmax string (sharpened when mass is smeared over variants). From
        engine heads (:mod:`lm_eval_safe.ensemble.certified`): the same string, or None where the heads
        do not settle it (the caller then completes the views)."""
        if all(is_full(v.logprobs) for v in views):
            return self.aggregator.choose(views)
        return self.aggregator.choose_from_heads(views)

    def decide(
        self, views: list[View], drafted: int, sampler: RowSampler | None, traced: bool = False
    ) -> Any:
        """Steps returning the :class:`Decision` at one ensemble point: greedy from the heads
        where they certify it (widened first where a head is too short), else from the full
        rows; sampled from the full rows. The loop asks this one question per point."""
        test: dict[str, float] | None = {} if traced and sampler is not None else None
        heads = not all(is_full(v.logprobs) for v in views)
        choice = None
        if sampler is None:
            choice = self.choose(views)
            short = self.aggregator.short_heads(views) if choice is None else []
            if short:  # the drafter's head of one id: its top ids, not its whole row
                views = yield from widen_views(views, short, self.head_width)
                choice = self.choose(views)
        certified = None
        if heads:
            # sampling draws from the whole ensemble distribution and a greedy choice the
            # heads left open is taken on the full ones; a trace shows the ensemble's top
            # strings, so it completes certified points too (not counted as full decisions)
            certified = choice is not None
            if choice is None or traced:
                views = yield from complete_views(views)
        if sampler is not None:
            choice = self.sample(views, drafted, sampler, test)
        elif choice is None:
            choice = self.choose(views)
        assert choice is not None
        return Decision(choice, views, test, certified)

    @property
    def head_width(self) -> int:
        """Ids a widened head holds (:func:`~lm_eval_safe.engines.spec.head_width`), as an
        engine's own."""
        return head_width(self.options.top_logprobs, self.options.top_k)

    # -- sampled ----------------------------------------------------------------------------
    def sample(
        self, views: list[View], drafted: int, sampler: RowSampler, test: dict[str, float] | None = None
    ) -> Choice:
        """Speculative sampling at an ensemble point, over strings.

        P_draft is the drafter's warped distribution summed per string; P_ens the aggregate of
        every member's warped distribution (the same code as the greedy argmax), restricted to
        strings the drafter can write and renormalised (the aggregator's
        :meth:`~lm_eval_safe.ensemble.aggregator.Aggregator.target`). The drafted string is kept
        with probability min(1, P_ens/P_draft), else replaced by a draw from the residual
        norm(max(0, P_ens - P_draft)): the string emitted is distributed as P_ens.
        """
        warped = [View(sampler.warp(v.logprobs), v.vocab, v.tokenizer, v.weight) for v in views]
        target = self.aggregator.target(warped, drafted)
        total = float(target.probs.sum())
        if total <= 0.0:  # the members share no string the drafter can write: keep its draw
            return Choice(self.drafter.vocab.keys[drafted], 0.0, False)
        probs = target.probs / total
        index = sampler.keep_or_resample(probs, target.draft, target.drafted, test)
        if index == target.drafted:
            return Choice(self.drafter.vocab.keys[drafted], float(probs[index]), target.sharpened)
        return Choice(target.keys[index], float(probs[index]), target.sharpened)

    # -- traces -----------------------------------------------------------------------------
    def candidates(self, views: list[View], sampler: RowSampler | None) -> tuple[list[Any], list[Any]]:
        """Each member's and the ensemble's most probable strings at a point (for traces): the
        distributions the choice was made from (warped when sampling)."""
        if sampler is not None:
            views = [View(sampler.warp(v.logprobs), v.vocab, v.tokenizer, v.weight) for v in views]
        members = [top_candidates(v.vocab.keys, v.logprobs.exp()) for v in views]
        return members, self.aggregator.candidates(views)

    # -- strings as drafter ids -------------------------------------------------------------
    def to_drafter_ids(self, choice: Choice, drafted: int) -> list[int]:
        """The chosen string as drafter ids (docs/algorithm.md, Aggregators): the ids the rule
        named where it did, else the drafter's EOS, its own token, or as much of the encoding
        as the aggregator writes (:mod:`lm_eval_safe.ensemble.writing`); the drafted token
        where the drafter cannot write the string or drafted it already."""
        if choice.drafter_ids is not None:
            return list(choice.drafter_ids)
        vocab = self.drafter.vocab
        way = route(self.drafter, choice.key)
        if way == EOS:
            return [self.drafter.eos_id]  # type: ignore[list-item]
        if way == KEEP_DRAFTED or vocab.keys[drafted] == choice.key:
            return [drafted]
        if way == TOKEN:
            return [vocab.lookup[choice.key]]
        assert way == ENCODE
        ids = vocab.encode_text(self.drafter.tokenizer, choice.key.decode("utf-8"))
        if not ids:
            return [drafted]
        return self.aggregator.written_ids(ids)
