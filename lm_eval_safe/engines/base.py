"""The engine seam: what the decoder and the scorer ask of a member's compute, and nothing more.

The decoder never runs a model itself. A request's loop yields coarse calls, one member at a
time, and the batch driver hands every row's calls for one member to that member's
:class:`EngineBatch` at once:

- :class:`Draft`: feed these ids, then draft up to ``n`` tokens (argmax, or draws of the
  request's sampler), returning each token with the distribution it came from;
- :class:`Forward`: feed these ids and return the next-token distributions after the listed
  positions (a verifier scoring a drafted window);
- :class:`Complete`: the whole next-token distribution at positions an engine first answered
  with its head only (rare: a decision the head cannot certify, sampling from the ensemble).

Calls speak of a row's *sequence* (prompt ids, then generated ids): ``keep`` says how many of
its leading ids stay as they were, ``ids`` what follows them. How an engine keeps those ids
(transformers: a KV cache row per request; vLLM: the whole sequence re-submitted, its prefix
read from vLLM's prefix cache) is its own business, as vLLM's ``v1/engine`` client never sees
how the core batches or caches.

An answered position (a :data:`Row`) is either the full log-softmax over the member's tokenizer
ids (a 1-D tensor: what the transformers engine computes anyway) or a :class:`TopLogprobs`: the
``K`` most probable ids and the log-probs of every other id the engine was asked about (the
drafted or scored token). What the decoder decides from a :class:`TopLogprobs` it decides
exactly or not at all (:mod:`lm_eval_safe.ensemble.certified`); the rest asks :class:`Complete`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

#: Added to the mass a head leaves (1 - the sum of its probabilities, computed from float32
#: log-probs that may sum to slightly more than 1), so a bound on the ids it does not know is
#: never too tight.
MASS_SLACK = 1e-5


@dataclass(eq=False)
class TopLogprobs:
    """One position's next-token distribution as far as an engine returned it.

    ``ids``/``logprobs``: the most probable ids, best first (at least one). ``known``: every id
    whose log-prob is known, those included (an engine also returns the token it drafted or
    was asked to score, wherever it ranks). No id outside ``known`` is more probable than the
    last of ``ids`` (:attr:`ceiling`), and together they hold :attr:`remaining` of the mass.
    ``handle`` is the engine's own note of where the position is, for :class:`Complete`.
    """

    ids: list[int]
    logprobs: list[float]
    known: dict[int, float]
    handle: Any = None
    #: ``exp`` of the largest log-prob as the engine's own float32 arithmetic gives it (the
    #: transformers engine: what a full row's ``row.max().exp()`` is), else None
    max_probability: float | None = None

    @property
    def argmax(self) -> int:
        return self.ids[0]

    @property
    def max_logprob(self) -> float:
        return self.logprobs[0]

    @property
    def ceiling(self) -> float:
        """Probability no unknown id exceeds (that of the K-th most probable id)."""
        return math.exp(self.logprobs[-1])

    @property
    def remaining(self) -> float:
        """Probability mass of the ids outside ``known`` (never negative)."""
        return max(0.0, 1.0 - sum(math.exp(lp) for lp in self.known.values()))

    def probability_bounds(self, token: int) -> tuple[float, float]:
        """``(low, high)`` of one id's probability: exact when known."""
        lp = self.known.get(token)
        if lp is not None:
            p = math.exp(lp)
            return p, p
        return 0.0, min(self.ceiling, self.remaining + MASS_SLACK)


def argmax_first(
    argmax: int, best: float, values: Sequence[float], ids: Sequence[float]
) -> tuple[list[int], list[float]]:
    """``topk``'s ids and values (best first; ids as numbers) as many as came, ``torch.argmax``'s
    id first: the first of equal maxima, where ``topk`` may list another of them before it."""
    head_ids, head_values = [argmax], [best]
    for lp, token in zip(values, ids, strict=True):
        if int(token) != argmax:
            head_ids.append(int(token))
            head_values.append(lp)
    wanted = len(values)
    return head_ids[:wanted], head_values[:wanted]  # the argmax was among them, or ties past it


def widened(head: TopLogprobs, values: Sequence[float], ids: Sequence[float]) -> TopLogprobs:
    """``head`` with its row's most probable ids (``topk``'s ``values`` and ``ids``), still
    knowing every id it knew (a drafted or scored token's log-prob)."""
    top_ids, top_values = argmax_first(head.argmax, head.max_logprob, values, ids)
    known = dict(head.known)
    known.update(zip(top_ids, top_values, strict=True))
    return TopLogprobs(top_ids, top_values, known, head.handle, head.max_probability)


def consistent_row(row: torch.Tensor, head: TopLogprobs) -> torch.Tensor:
    """``row``, a full distribution computed again for the position ``head`` came from, as the
    distribution the head describes: the head's log-probs where it knows them, nowhere else more
    than its last id (:attr:`TopLogprobs.ceiling`), and no more mass outside them than it leaves
    (with :data:`MASS_SLACK`). Two computations of one position may differ in their last bits
    (an engine batches a request with others), and a decision taken on the full row must be one
    the head's bounds allow: certified from the head, it is the one taken on this row."""
    out = row.clamp(max=head.logprobs[-1])
    known = torch.tensor(list(head.known), dtype=torch.long)
    out[known] = torch.tensor(list(head.known.values()), dtype=row.dtype)
    unknown = torch.ones(row.numel(), dtype=torch.bool)
    unknown[known] = False
    mass = float(out[unknown].double().exp().sum())
    allowed = head.remaining + MASS_SLACK
    if mass > allowed:
        out[unknown] += math.log(allowed / mass)
    return out


def head_of(row: torch.Tensor, top: int, head: TopLogprobs) -> TopLogprobs:
    """A head of ``top`` ids cut from the full row behind ``head`` (an engine that widens heads
    by fetching the row: every value from the row, ``head``'s known ids included)."""
    best = torch.topk(row, min(top, row.numel()))
    argmax = int(torch.argmax(row))
    ids, values = argmax_first(argmax, float(row[argmax]), best.values.tolist(), best.indices.tolist())
    known = {token: float(row[token]) for token in head.known}
    known.update(zip(ids, values, strict=True))
    return TopLogprobs(ids, values, known, head.handle, float(row[argmax].exp()))


#: One answered position: the full log-softmax (transformers), or the head of it (vLLM).
Row = torch.Tensor | TopLogprobs


def is_full(row: Row) -> bool:
    return isinstance(row, torch.Tensor)


def row_argmax(row: Row) -> int:
    if isinstance(row, torch.Tensor):
        return int(torch.argmax(row))
    return row.argmax


def row_max_probability(row: Row) -> float:
    """The largest next-token probability (GaC's gate, the threshold schedule)."""
    if isinstance(row, torch.Tensor):
        return float(row.max().exp())
    if row.max_probability is not None:
        return row.max_probability
    return math.exp(row.max_logprob)


def row_probability_bounds(row: Row, token: int) -> tuple[float, float]:
    if isinstance(row, torch.Tensor):
        p = float(row[token].exp())
        return p, p
    return row.probability_bounds(token)


# -- calls ------------------------------------------------------------------------------------
@dataclass
class Forward:
    """Keep ``keep`` ids of the row's sequence, feed ``ids`` after them and return the next-token
    distribution after each index in ``want`` (indices into ``ids``): a list of :data:`Row`."""

    member: int
    keep: int
    ids: list[int]
    want: list[int] = field(default_factory=list)


@dataclass
class Draft:
    """Keep ``keep`` ids, feed ``ids``, then append up to ``n`` tokens: each the argmax of its
    distribution, or with ``sampler`` (a :class:`~lm_eval_safe.ensemble.sampling.RowSampler`) a draw from
    the request's warped distribution; drafting stops after a token in ``stop_ids``. Answered
    with a :class:`Drafted`. The drafted tokens are the row's sequence from then on, all but the
    last fed (the next call's ``keep`` says what stays)."""

    member: int
    keep: int
    ids: list[int]
    n: int
    stop_ids: frozenset[int] = frozenset()
    sampler: Any = None
    #: stop strings an engine that drafts a whole budget in one call (``stops_on_text``) may
    #: stop at: the draft then ends with the token completing one (the decoder cuts the text)
    until: tuple[str, ...] = ()
    #: whether the caller reads the distributions the tokens came from (the drafter alone reads
    #: tokens only: an engine may then answer with ``Drafted.rows`` empty)
    rows: bool = True


@dataclass
class Drafted:
    tokens: list[int]
    rows: list[Row]  # rows[i]: the distribution tokens[i] came from (empty: Draft.rows False)


@dataclass
class Complete:
    """The full distributions (1-D log-softmax tensors) of rows this member's engine returned
    as :class:`TopLogprobs`, in order; with ``top``, wider heads instead: each row's ``top``
    most probable ids (a :class:`TopLogprobs` knowing at least what the row knew). A greedy
    decision that a short head cannot name the candidates of (UniTE's top-k strings from a
    drafter head of one id) asks for this first: a few ids read back instead of a whole
    vocabulary, and the aggregate computed on the host over a few strings instead of all."""

    member: int
    rows: list[TopLogprobs]
    top: int = 0


Call = Forward | Draft | Complete


# -- engines ----------------------------------------------------------------------------------
#: what :meth:`MemberEngine.score_tokens` scores: (context ids, continuation ids) pairs
ScorePairs = Sequence[tuple[list[int], list[int]]]
#: one continuation's scores: each token's log-prob, and whether it is the position's argmax
TokenScores = tuple[list[float], list[bool]]
#: called with how many pairs were scored since the last call
Progress = Callable[[int], Any]


@dataclass
class EngineCounters:
    """What an engine did, cumulative (the model reads differences, as with prefill counts)."""

    calls: int = 0  # batched calls answered (one per member per batch step, all rows together)
    seconds: float = 0.0  # wall time inside those calls
    prefill_tokens: int = 0  # prompt tokens looked up (transformers) or submitted (vLLM)
    prefill_tokens_saved: int = 0  # of those, states read from a prefix cache
    full_rows: int = 0  # Complete positions served (engines that answer with top-K only)


class EngineBatch(ABC):
    """One member's state for the rows of a generation batch (a row per request)."""

    #: the order :meth:`run` answers the kinds of call in, all rows' calls of one kind together
    answer_order: tuple[type, ...] = (Draft, Forward, Complete)
    #: the engine as messages name it
    engine_title: str = "this"

    @abstractmethod
    def add_row(self) -> int:
        """An empty row at the end of the batch; returns its index."""

    @abstractmethod
    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not listed (finished requests); the listed rows become rows ``0 ..
        len(rows) - 1`` in the order listed (the batch driver lists them in the order that moves
        the fewest, not always ascending)."""

    def run(self, calls: dict[int, Call]) -> dict[int, Any]:
        """Answer every row's call (row index -> call) at once: each kind's calls together
        (:meth:`answer_drafts`, :meth:`answer_forwards`, :meth:`answer_completes`), the kinds
        in :attr:`answer_order`."""
        groups = {kind: {r: c for r, c in calls.items() if isinstance(c, kind)} for kind in self.answer_order}
        if sum(len(group) for group in groups.values()) != len(calls):
            raise TypeError(f"the {self.engine_title} engine answers Draft, Forward and Complete calls only")
        answer: dict[type, Callable[[Any], dict[int, Any]]] = {
            Draft: self.answer_drafts,
            Forward: self.answer_forwards,
            Complete: self.answer_completes,
        }
        results: dict[int, Any] = {}
        for kind, group in groups.items():
            if group:
                results.update(answer[kind](group))
        return results

    @abstractmethod
    def answer_drafts(self, calls: dict[int, Draft]) -> dict[int, Drafted]:
        """The rows' :class:`Draft` calls."""

    @abstractmethod
    def answer_forwards(self, calls: dict[int, Forward]) -> dict[int, list[Any]]:
        """The rows' :class:`Forward` calls: each row's answered positions, in order."""

    @abstractmethod
    def answer_completes(self, calls: dict[int, Complete]) -> dict[int, list[Any]]:
        """The rows' :class:`Complete` calls: each row's full rows (or wider heads), in order."""


class MemberEngine(ABC):
    """One member's compute: generation batches and the scoring of given continuations."""

    #: the registry name of its engine (what ``engine=`` names)
    kind: str
    #: whether rows are full log-softmax tensors (else :class:`TopLogprobs`)
    full_rows: bool
    #: whether one Draft call can run a whole budget and stop at stop strings itself (vLLM);
    #: the drafter alone then drafts in one call instead of window by window
    stops_on_text: bool = False

    def __init__(self) -> None:
        self.counters = EngineCounters()
        self.member: Any = None  # the Member this engine computes (bound when it is built)

    def bind(self, member: Any) -> None:
        self.member = member

    @abstractmethod
    def new_batch(self) -> EngineBatch: ...

    @abstractmethod
    def score_tokens(
        self,
        pairs: ScorePairs,
        batch_size: int | str,
        max_batch_size: int,
        progress: Progress | None = None,
    ) -> list[TokenScores]:
        """Per-token log-probs of each continuation given its context and whether each token is
        the argmax, windowed as lm-eval's backend for this engine windows them. An engine's
        scoring module writes it as a function of the engine and these same parameters (the
        engine's method hands them over as they came)."""

    @property
    @abstractmethod
    def rolling_window(self) -> int:
        """Most tokens one scoring window predicts: the ``max_seq_len`` of lm-eval's rolling
        windows for the engine, and the longest continuation a loglikelihood request may have."""

    @property
    @abstractmethod
    def sequence_limit(self) -> int:
        """Most ids a row's sequence may hold when a call asks for the distribution after its
        last id (a verifier's prompt and text)."""

    @property
    def shares_prefixes(self) -> bool:
        """Whether requests sharing a prompt prefix reuse its states (ordering pays off)."""
        return False

    def prefill_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up, of those read from a prefix cache), cumulative."""
        return 0, 0

    def forget_prefixes(self) -> None:  # noqa: B027 (an engine without a prefix cache: nothing)
        """Empty the engine's prefix cache (benchmarks: no run inherits an earlier one's)."""

    @contextmanager
    def active(self) -> Iterator[None]:
        """Engine-specific settings for the calls run inside this block."""
        yield

    def describe(self) -> dict[str, Any]:
        return {"engine": self.kind}

    def identity(self) -> dict[str, Any]:
        """What outputs depend on beyond the weights and dtype (``--use_cache`` keys)."""
        return {}
