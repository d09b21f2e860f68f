"""When to ensemble (docs/algorithm.md, Schedules and Consensus): one class per schedule, chosen once from the options.

A schedule looks at one cycle's drafted window and says which drafted positions are ensemble
points, syncing the verifiers only when its rule needs their distributions. SAFE and the
paper's baselines are schedules of the same decoder loop, so a comparison between them compares
policies, not code bases:

- :class:`Safe`: aligned positions (a token boundary of every tokenizer) where the members do
  not already agree (:func:`consensus`); with ``aggregator=gac`` also GaC's own gate;
- :class:`Aligned`: every aligned position (SAFE without the consensus skip);
- :class:`EveryToken`: every token, misaligned ones included (the UniTE baseline);
- :class:`Threshold`: where the drafter's largest probability is below ``threshold`` (GaC);
- :class:`DrafterAlone`: never (the drafter alone through the same loop).

Greedy decoding takes the first point only (the text after it changes); sampling tests every
aligned point of the window in order (README "Sampling").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from lm_eval_safe.decoder.authors_alignment import authors_agree, paired_positions, verifier_ids
from lm_eval_safe.decoder.batch_driver import Steps
from lm_eval_safe.decoder.draft_window import DraftWindow
from lm_eval_safe.decoder.member_runs import VerifierRun
from lm_eval_safe.decoder.stats import GenerationStats
from lm_eval_safe.engines.base import (
    Row,
    is_full,
    row_argmax,
    row_max_probability,
    row_probability_bounds,
)
from lm_eval_safe.ensemble.aggregate import View
from lm_eval_safe.ensemble.certified import Interval, certified_consensus
from lm_eval_safe.ensemble.consensus import GAC_GATE, consensus
from lm_eval_safe.ensemble.ensembler import complete_views
from lm_eval_safe.members.member import Member
from lm_eval_safe.members.vocabulary import boundary_index, is_char_boundary, valid_utf8_prefix
from lm_eval_safe.options import SafeOptions


@dataclass
class Draft:
    """One cycle's drafted window: the generated text before it, its tokens and the drafter's
    log-probs predicting each."""

    committed: bytes
    tokens: list[int]
    logprobs: list[Row]  # full log-softmax tensors, or an engine's heads (TopLogprobs)
    committed_ids: list[int]  # the drafter's ids of ``committed``


@dataclass
class EnsemblePoint:
    position: int  # index into the drafted tokens
    views: list[View]


class Schedule(ABC):
    """Which drafted positions of a cycle to ensemble."""

    name: str
    needs_verifiers = True

    def __init__(self, drafter: Member, weights: list[float]):
        self.drafter = drafter
        self.weights = weights  # drafter first, then the verifiers in order

    def draft_size(self, window: DraftWindow, budget: int) -> int:
        return min(window.size, budget)

    @abstractmethod
    def points(
        self, draft: Draft, verifiers: list[VerifierRun], stats: GenerationStats, sampled: bool
    ) -> Steps:
        """Steps returning ``(points, judged)``: the ensemble points in order and how many
        drafted positions that settles (later ones wait for the next cycle)."""

    def _drafter_view(self, row: Row) -> View:
        return View(row, self.drafter.vocab, self.drafter.tokenizer, self.weights[0])

    def _views_at_end(
        self,
        verifiers: list[VerifierRun],
        text_bytes: bytes,
        drafter_row: Row,
        stats: GenerationStats,
    ) -> Steps:
        """Views after each verifier's full tokenization of the text (OOV-like where misaligned:
        the behaviour of the every-token and threshold baselines, counted in the stats)."""
        text = valid_utf8_prefix(text_bytes)
        aligned = len(text.encode("utf-8")) == len(text_bytes)
        views = [self._drafter_view(drafter_row)]
        for verifier, weight in zip(verifiers, self.weights[1:], strict=True):
            ids, ends = yield from verifier.sync_steps(text, text_bytes)
            aligned = aligned and ends is not None and (not ends or ends[-1] == len(text_bytes))
            member = verifier.member
            views.append(View(verifier.pred[len(ids)], member.vocab, member.tokenizer, weight))
        stats.misaligned_ensembles += int(not aligned)
        return views


class DrafterAlone(Schedule):
    name = "drafter"
    needs_verifiers = False

    def draft_size(self, window: DraftWindow, budget: int) -> int:
        """Nothing to verify: an engine that stops at stop strings itself drafts the whole
        budget in one call (greedy drafting gives the same tokens in any window)."""
        return budget if self.drafter.engine.stops_on_text else min(window.size, budget)

    def points(
        self, draft: Draft, verifiers: list[VerifierRun], stats: GenerationStats, sampled: bool
    ) -> Steps:
        yield from ()
        return [], len(draft.tokens)


class EveryToken(Schedule):
    """One token per cycle, each an ensemble point, aligned or not (UniTE's baseline)."""

    name = "every"

    def draft_size(self, window: DraftWindow, budget: int) -> int:
        return 1

    def points(
        self, draft: Draft, verifiers: list[VerifierRun], stats: GenerationStats, sampled: bool
    ) -> Steps:
        views = yield from self._views_at_end(verifiers, draft.committed, draft.logprobs[0], stats)
        return [EnsemblePoint(0, views)], 1


class Threshold(Schedule):
    """GaC's baseline: the first position where the drafter's largest probability is below
    ``threshold`` (it reads the drafter's distribution only, never the token drawn)."""

    name = "threshold"

    def __init__(self, drafter: Member, weights: list[float], threshold: float):
        super().__init__(drafter, weights)
        self.threshold = threshold

    def points(
        self, draft: Draft, verifiers: list[VerifierRun], stats: GenerationStats, sampled: bool
    ) -> Steps:
        for j, row in enumerate(draft.logprobs):
            if row_max_probability(row) < self.threshold:
                prefix = draft.committed + self.drafter.vocab.spell(draft.tokens[:j])
                views = yield from self._views_at_end(verifiers, prefix, row, stats)
                return [EnsemblePoint(j, views)], j + 1
        return [], len(draft.tokens)


class Aligned(Schedule):
    """Every position that is a token boundary of every member's tokenization (SAFE without
    its consensus skip, and the base of :class:`Safe`)."""

    name = "aligned"
    skips_on_consensus = False
    gac_gate = False

    def points(
        self, draft: Draft, verifiers: list[VerifierRun], stats: GenerationStats, sampled: bool
    ) -> Steps:
        """Drafter-side filters first, so a cycle with no candidate position costs no verifier
        forward at all (the verifier caches catch up in a later cycle).

        Sampling: the start of the generation is a token boundary of every member whatever is
        drawn there (each tokenizes the prompt and the generated text apart), so it is not judged
        from the drafted token, and the first string is distributed exactly as P_ens."""
        vocab, eos_ids = self.drafter.vocab, self.drafter.eos_ids
        full = draft.committed + vocab.spell(draft.tokens)
        start = sampled and not draft.committed
        candidates: list[tuple[int, int]] = []  # (drafted index, byte offset before it)
        offset = len(draft.committed)
        for j, token in enumerate(draft.tokens):
            here = offset
            offset += len(vocab.text_bytes[token])
            if self.gac_gate and row_max_probability(draft.logprobs[j]) >= GAC_GATE:
                # a confident drafter is never ensembled (its largest probability: the drafted
                # token's own when greedy; never the token drawn)
                continue
            is_eos = token in eos_ids
            if not (start and j == 0) and (
                (not is_eos and here == offset) or not is_char_boundary(full, here)
            ):
                continue
            candidates.append((j, here))
        if not candidates:
            return [], len(draft.tokens)
        text = valid_utf8_prefix(full)
        want = {here for _, here in candidates}
        synced = []
        for verifier in verifiers:
            ids, ends = yield from verifier.sync_steps(text, full, want)
            if ends is None and not start:
                return [], len(draft.tokens)
            synced.append((verifier, ids, ends))
        points: list[EnsemblePoint] = []
        for j, here in candidates:
            token = draft.tokens[j]
            if start and j == 0:
                indices: list[tuple[int, int | None]] | None = [(0, None)] * len(synced)
            else:
                indices = self._aligned_indices(synced, here, token in eos_ids)
            if indices is None:
                continue
            stats.aligned_positions += 1
            views = [self._drafter_view(draft.logprobs[j])]
            views += [
                View(verifier.pred[i], verifier.member.vocab, verifier.member.tokenizer, w)
                for (verifier, _, _), (i, _), w in zip(synced, indices, self.weights[1:], strict=True)
            ]
            if self.skips_on_consensus and not sampled:
                agree = self._agree(views, token, indices)
                if agree is None:  # heads that cannot settle rule (b): the full distributions
                    stats.full_decisions += 1
                    views = yield from complete_views(views)
                    agree = self._agree(views, token, indices)
                elif not all(is_full(v.logprobs) for v in views):
                    stats.certified_decisions += 1
                if agree:
                    stats.consensus_skips += 1
                    continue
            points.append(EnsemblePoint(j, views))
            if not sampled:
                return points, j + 1
        return points, len(draft.tokens)

    @staticmethod
    def _aligned_indices(
        synced: list[tuple[VerifierRun, list[int], list[int] | None]], here: int, is_eos: bool
    ) -> list[tuple[int, int | None]] | None:
        """Each verifier's index predicting the token at byte ``here`` and its own next token
        there, or None when ``here`` is not a boundary of every verifier's tokenization."""
        indices: list[tuple[int, int | None]] = []
        for verifier, ids, ends in synced:
            i = None if ends is None else boundary_index(ends, here)
            if i is None:
                return None
            own = ids[i] if i < len(ids) else (verifier.member.eos_id if is_eos else None)
            if own is None or (is_eos and i < len(ids)):
                return None
            indices.append((i, own))
        return indices

    @staticmethod
    def _agree(views: list[View], token: int, indices: list[tuple[int, int | None]]) -> bool | None:
        """SAFE's consensus rule at a point; None when engine heads leave rule (b) open."""
        owns = [own for _, own in indices]
        argmax_is_own = [row_argmax(v.logprobs) == own for v, own in zip(views[1:], owns, strict=True)]
        weights = [v.weight for v in views]
        if all(is_full(v.logprobs) for v in views):
            return consensus(
                argmax_is_own,
                [float(views[0].logprobs[token].exp())]
                + [float(v.logprobs[own].exp()) for v, own in zip(views[1:], owns, strict=True)],
                weights,
            )
        bounds = [row_probability_bounds(views[0].logprobs, token)] + [
            row_probability_bounds(v.logprobs, own) for v, own in zip(views[1:], owns, strict=True)
        ]
        return certified_consensus(argmax_is_own, [Interval(*b) for b in bounds], weights)


class Safe(Aligned):
    """SAFE: aligned positions where the members disagree; with GaC, a confident drafter is
    never ensembled either (the paper's GaC+SAFE)."""

    name = "safe"
    skips_on_consensus = True

    def __init__(self, drafter: Member, weights: list[float], gac_gate: bool):
        super().__init__(drafter, weights)
        self.gac_gate = gac_gate


class AuthorsSafe(Schedule):
    """SAFE as the authors' code finds its ensemble points (``reference=authors``;
    :mod:`lm_eval_safe.decoder.authors_alignment`): verifier positions paired with drafted ones by
    their stripped decoded prefixes, tested in the verifier's order; skipped when the verifier's
    argmax is its own token or the two probabilities of the own tokens sum to 1 or more; with
    GaC, also where the drafter is at least 0.5 sure. Two members, greedy only (the options and
    the decoder refuse anything else). The last window is drafted whole, as their code drafts
    it, so the verifier reads the same text at the end of the budget."""

    name = "safe"

    def __init__(self, drafter: Member, weights: list[float], gac_gate: bool):
        super().__init__(drafter, weights)
        self.gac_gate = gac_gate

    def draft_size(self, window: DraftWindow, budget: int) -> int:
        return window.size

    def points(
        self, draft: Draft, verifiers: list[VerifierRun], stats: GenerationStats, sampled: bool
    ) -> Steps:
        (verifier,) = verifiers
        drafter_tokenizer, verifier_tokenizer = self.drafter.tokenizer, verifier.member.tokenizer
        ids = verifier_ids(drafter_tokenizer, verifier_tokenizer, draft.committed_ids + draft.tokens)
        pairs = [
            (j, i)
            for j, i in paired_positions(
                drafter_tokenizer, verifier_tokenizer, draft.committed_ids, draft.tokens, ids, self.gac_gate
            )
            if not (self.gac_gate and row_max_probability(draft.logprobs[j]) >= GAC_GATE)
        ]
        if not pairs:
            return [], len(draft.tokens)
        yield from verifier.feed_steps(ids, {i for _, i in pairs})
        for j, i in pairs:
            stats.aligned_positions += 1
            views = [self._drafter_view(draft.logprobs[j])]
            views.append(View(verifier.pred[i], verifier.member.vocab, verifier_tokenizer, self.weights[1]))
            if not all(is_full(v.logprobs) for v in views):
                stats.full_decisions += 1
                views = yield from complete_views(views)
            drafter_row, verifier_row = (v.logprobs for v in views)
            if authors_agree(
                float(drafter_row[draft.tokens[j]].exp()),
                float(verifier_row[ids[i]].exp()),
                row_argmax(verifier_row) == ids[i],
            ):
                stats.consensus_skips += 1
                continue
            return [EnsemblePoint(j, views)], j + 1
        return [], len(draft.tokens)


def make_schedule(options: SafeOptions, drafter: Member, weights: list[float], verifiers: int) -> Schedule:
    """The options' schedule (the drafter alone when there is no verifier)."""
    if not verifiers or options.schedule == "drafter":
        return DrafterAlone(drafter, weights)
    if options.schedule == "every":
        return EveryToken(drafter, weights)
    if options.schedule == "threshold":
        return Threshold(drafter, weights, options.threshold)
    if options.schedule == "aligned":
        return Aligned(drafter, weights)
    if options.reference == "authors":
        return AuthorsSafe(drafter, weights, gac_gate=options.aggregator == "gac")
    return Safe(drafter, weights, gac_gate=options.aggregator == "gac")
