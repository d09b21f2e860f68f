"""What happens at an ensemble point (docs/algorithm.md, Aggregators): the aggregate's choice (greedy)
or speculative sampling's keep-or-replace (README "Sampling"), and the chosen string as the
drafter's ids.

The aggregators themselves (``gac``, ``unite``, sharpening) are in :mod:`lm_eval_safe.ensemble.aggregate`;
this module applies them for one drafter, which is what decides which strings can be written.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, NamedTuple

import torch

from lm_eval_safe.disk_cache import cache_root
from lm_eval_safe.engines.base import Complete, is_full
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
from lm_eval_safe.ensemble.authors.aggregate import AuthorsGac, authors_aggregator
from lm_eval_safe.ensemble.certified import as_head, certified_gac, certified_unite, short_heads
from lm_eval_safe.ensemble.sampling import RowSampler
from lm_eval_safe.members.member import Member
from lm_eval_safe.members.vocabulary import EOS_KEY
from lm_eval_safe.options import SafeOptions

# How a string becomes drafter ids (see Ensembler._route).
_EOS, _TOKEN, _ENCODE, _FALLBACK = "eos", "token", "encode", "fallback"


def complete_views(views: list[View]) -> Any:
    """Steps returning ``views`` with every engine head replaced by its full distribution (one
    :class:`~lm_eval_safe.engines.base.Complete` call per member that answered with a head).
    Views are in member-slot order (the drafter first), as every schedule builds them."""
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
        self._union: UnionVocabulary | None = None
        # reference=authors: the authors' code decides (two members, full distributions)
        self.authors = None
        if options.reference == "authors" and verifiers:
            o = options
            self.authors = authors_aggregator(
                drafter, verifiers[0], o.aggregator, o.sharpen, o.sharpen_lambda, o.top_k
            )

    @property
    def union(self) -> UnionVocabulary:
        """GaC's union vocabulary, built (or read from its disk cache) on first use."""
        if self._union is None:
            vocabs = [self.drafter.vocab] + [v.vocab for v in self.verifiers]
            self._union = UnionVocabulary.build(vocabs, cache_root(self.options.cache_dir))
        return self._union

    # -- greedy -----------------------------------------------------------------------------
    def choose(self, views: list[View]) -> Choice | None:
        """The aggregate's argmax string (sharpened when mass is smeared over variants). From
        engine heads (:mod:`lm_eval_safe.ensemble.certified`): the same string, or None where the heads
        do not settle it (the caller then completes the views)."""
        o = self.options
        if self.authors is not None:
            return self.authors.choose(views) if all(is_full(v.logprobs) for v in views) else None
        if all(is_full(v.logprobs) for v in views):
            if o.aggregator == "gac":
                return gac(views, self.union, o.sharpen, o.sharpen_lambda, o.top_k)
            return unite(views, o.sharpen, o.sharpen_lambda, o.top_k)
        heads = [as_head(v, self.head_width) for v in views]
        if o.aggregator == "gac":
            return certified_gac(heads, self.union, o.sharpen, o.sharpen_lambda, o.top_k)
        return certified_unite(heads, o.sharpen, o.sharpen_lambda, o.top_k)

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
            short = self.short_heads(views) if choice is None else []
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

    def short_heads(self, views: list[View]) -> list[int]:
        """The views whose heads are too short for :meth:`choose` to name the candidates from
        (UniTE's top-k strings, and GaC's heuristic sharpening's): a greedy decision widens them
        (:func:`widen_views`) before it asks for the full distributions."""
        o = self.options
        if self.authors is not None or (o.aggregator == "gac" and o.sharpen != "heuristic"):
            return []
        return short_heads(views, o.top_k)

    @property
    def head_width(self) -> int:
        """Ids a head holds (:func:`~lm_eval_safe.engines.spec.head_width`): an engine's, a widened
        one, a full row's cut for a decision beside engine heads."""
        return head_width(self.options.top_logprobs, self.options.top_k)

    # -- sampled ----------------------------------------------------------------------------
    def sample(
        self, views: list[View], drafted: int, sampler: RowSampler, test: dict[str, float] | None = None
    ) -> Choice:
        """Speculative sampling at an ensemble point, over strings.

        P_draft is the drafter's warped distribution summed per string; P_ens the aggregate of
        every member's warped distribution (the same code as the greedy argmax), restricted to
        strings the drafter can write and renormalised. The drafted string is kept with
        probability min(1, P_ens/P_draft), else replaced by a draw from the residual
        norm(max(0, P_ens - P_draft)): the string emitted is distributed as P_ens.
        """
        o = self.options
        warped = [View(sampler.warp(v.logprobs), v.vocab, v.tokenizer, v.weight) for v in views]
        drafter_probs = warped[0].logprobs.exp()
        if o.aggregator == "gac":
            target = gac_distribution(warped, self.union, o.sharpen, o.sharpen_lambda, o.top_k)
            mapping = self.union.maps[0]
            draft = torch.zeros(len(self.union), dtype=torch.float64)
            draft.scatter_add_(0, mapping, drafter_probs)
            drafted_index = int(mapping[drafted])
            probs = target.probs * self._union_sayable
        else:
            # unite's strings, then one slot for every other string (P_ens is 0 there)
            target = unite_distribution(warped, o.sharpen, o.sharpen_lambda, o.top_k)
            ids_of = self.drafter.vocab.ids_of  # several ids may spell one string: P_draft sums them
            draft = torch.tensor(
                [float(drafter_probs[list(ids_of.get(key, ()))].sum()) for key in target.keys]
                + [0.0],
                dtype=torch.float64,
            )
            draft[-1] = max(0.0, 1.0 - float(draft.sum()))
            key = self.drafter.vocab.keys[drafted]
            drafted_index = target.keys.index(key) if key in target.keys else len(target.keys)
            sayable = [self.can_write(k) for k in target.keys] + [False]
            probs = torch.cat([target.probs, torch.zeros(1, dtype=torch.float64)])
            probs = probs * torch.tensor(sayable, dtype=torch.float64)
        total = float(probs.sum())
        if total <= 0.0:  # the members share no string the drafter can write: keep its draw
            return Choice(self.drafter.vocab.keys[drafted], 0.0, False)
        probs = probs / total
        index = sampler.keep_or_resample(probs, draft, drafted_index, test)
        if index == drafted_index:
            return Choice(self.drafter.vocab.keys[drafted], float(probs[index]), target.sharpened)
        return Choice(target.keys[index], float(probs[index]), target.sharpened)

    # -- traces -----------------------------------------------------------------------------
    def candidates(self, views: list[View], sampler: RowSampler | None) -> tuple[list[Any], list[Any]]:
        """Each member's and the ensemble's most probable strings at a point (for traces): the
        distributions the choice was made from (warped when sampling)."""
        o = self.options
        if sampler is not None:
            views = [View(sampler.warp(v.logprobs), v.vocab, v.tokenizer, v.weight) for v in views]
        members = [top_candidates(v.vocab.keys, v.logprobs.exp()) for v in views]
        if self.authors is not None:
            return members, self._authors_candidates(views)
        if o.aggregator == "gac":
            target = gac_distribution(views, self.union, o.sharpen, o.sharpen_lambda, o.top_k)
        else:
            target = unite_distribution(views, o.sharpen, o.sharpen_lambda, o.top_k)
        return members, top_candidates(target.keys, target.probs)

    def _authors_candidates(self, views: list[View]) -> list[Any]:
        """The authors' scores at a point (their strings, sharpened where it decided), best first."""
        if isinstance(self.authors, AuthorsGac):
            scores, _ = self.authors.table(views)
            return top_candidates([k.encode("utf-8") for k in self.authors.union.keys], scores)
        order, scores, _, _ = self.authors.table(views)
        return top_candidates([k.encode("utf-8") for k in order], scores)

    @cached_property
    def _union_sayable(self) -> torch.Tensor:
        """1.0 for each union string the drafter can write, else 0.0."""
        return torch.tensor([self.can_write(key) for key in self.union.keys], dtype=torch.float64)

    # -- strings as drafter ids -------------------------------------------------------------
    def _route(self, key: bytes) -> str:
        """How :meth:`to_drafter_ids` writes ``key``: the drafter's EOS, its own token, the
        encoding of the text, or not at all (another member's special token, bytes that are no
        UTF-8 text the drafter has no token for, EOS when the drafter has none): the drafted
        token stays."""
        if key == EOS_KEY:
            return _EOS if self.drafter.eos_id is not None else _FALLBACK
        if key in self.drafter.vocab.lookup:
            return _TOKEN
        if key.startswith(b"\x00"):
            return _FALLBACK
        try:
            key.decode("utf-8")
        except UnicodeDecodeError:
            return _FALLBACK
        return _ENCODE

    def can_write(self, key: bytes) -> bool:
        """The drafter writes ``key`` with ids of its own rather than keeping its drafted token."""
        return self._route(key) != _FALLBACK

    def to_drafter_ids(self, choice: Choice, drafted: int) -> list[int]:
        """The chosen string as drafter ids (docs/algorithm.md, Aggregators): gac keeps all ids, unite the first."""
        if choice.drafter_ids is not None:
            return list(choice.drafter_ids)
        vocab = self.drafter.vocab
        route = self._route(choice.key)
        if route == _EOS:
            return [self.drafter.eos_id]  # type: ignore[list-item]
        if route == _FALLBACK or vocab.keys[drafted] == choice.key:
            return [drafted]
        if route == _TOKEN:
            return [vocab.lookup[choice.key]]
        ids = vocab.encode_text(self.drafter.tokenizer, choice.key.decode("utf-8"))
        if not ids:
            return [drafted]
        return ids if self.options.aggregator == "gac" else ids[:1]
