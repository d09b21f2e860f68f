"""Scores of given continuations by the ensemble (docs/algorithm.md, Scoring): lm-eval's ``loglikelihood``
and ``loglikelihood_rolling``.

Each member scores every token of the continuation with its own tokenizer
(:mod:`lm_eval_safe.scoring.pairs`); the continuation is then cut at byte offsets that are token
boundaries of *every* member, within a segment each member's probability is the product of its
own token probabilities, and the ensemble log-probability is the sum over segments of the log
of the aggregated segment probability. With one member every token is a segment, which is
exactly lm-eval's ``hf`` score.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from lm_eval_safe.ensemble.consensus import GAC_GATE, consensus
from lm_eval_safe.errors import RequestError
from lm_eval_safe.members.member import Member
from lm_eval_safe.members.vocabulary import is_char_boundary
from lm_eval_safe.options import SafeOptions
from lm_eval_safe.scoring.pairs import encode_pair, score_members


@dataclass
class MemberScore:
    """One member's view of a scored text: per-token log-probs, argmax flags, byte ends."""

    logprobs: list[float]
    greedy: list[bool]
    ends: list[int] | None  # end offset of each token in the scored bytes; None: unknown


def _segments(scores: list[MemberScore], text: bytes) -> list[int]:
    """Segment ends: byte offsets that end a token of every member (and a UTF-8 character),
    plus the end of the text. A member whose tokens do not spell the text leaves one segment."""
    total = len(text)
    if any(s.ends is None for s in scores):
        return [total]
    common = set.intersection(*(set(s.ends or ()) for s in scores))
    return sorted(c for c in common if 0 < c < total and is_char_boundary(text, c)) + [total]


@dataclass
class Segments:
    """The scored text cut at common boundaries: per member, each segment's log-prob and its
    first token's log-prob and argmax flag; whether the drafter's tokens in it are its argmax."""

    cuts: list[int]  # byte offset where each segment ends
    logprobs: list[list[float]]  # [member][segment]
    first_logprobs: list[list[float | None]]
    first_greedy: list[list[bool]]
    drafted: list[bool]

    @classmethod
    def of(cls, scores: list[MemberScore], text: bytes, drafter: int = 0) -> Segments:
        cuts = _segments(scores, text)
        n_seg = len(cuts)
        seg_lp = [[0.0] * n_seg for _ in scores]
        first_lp: list[list[float | None]] = [[None] * n_seg for _ in scores]
        first_greedy: list[list[bool]] = [[True] * n_seg for _ in scores]
        drafted = [True] * n_seg
        for m, score in enumerate(scores):
            ends = score.ends or [len(text)] * len(score.logprobs)
            for lp, greedy, end in zip(score.logprobs, score.greedy, ends, strict=True):
                s = min(bisect.bisect_left(cuts, end), n_seg - 1)
                seg_lp[m][s] += lp
                if first_lp[m][s] is None:
                    first_lp[m][s], first_greedy[m][s] = lp, greedy
                if m == drafter and not greedy:
                    drafted[s] = False
        return cls(cuts, seg_lp, first_lp, first_greedy, drafted)

    def ensemble(self, weights: list[float], how: str) -> list[float]:
        """Each segment's ensemble log-probability: ``log sum_m w_m P_m(segment)`` (``mean``)
        or ``sum_m w_m log P_m(segment)`` (``logmean``), weights normalised."""
        norm = [w / sum(weights) for w in weights]
        values = []
        for s in range(len(self.cuts)):
            parts = [member[s] for member in self.logprobs]
            if how == "logmean":
                values.append(sum(w * lp for w, lp in zip(norm, parts, strict=True) if w > 0))
            else:
                top = max(lp for w, lp in zip(norm, parts, strict=True) if w > 0)
                values.append(
                    top
                    + math.log(
                        sum(w * math.exp(lp - top) for w, lp in zip(norm, parts, strict=True) if w > 0)
                    )
                )
        return values


def combine(
    scores: list[MemberScore],
    weights: list[float],
    how: str,
    text: bytes,
    drafter: int = 0,
    consensus: Callable[[list[float], list[bool]], bool] | None = None,
) -> tuple[float, bool]:
    """Ensemble log-probability over common boundaries, and the ``is_greedy`` flag.

    Score: the sum over segments of :meth:`Segments.ensemble`.

    ``is_greedy`` mirrors what greedy SAFE decoding from the context would do. Segment starts
    are exactly the positions where every tokenizer has a boundary, i.e. SAFE's only candidate
    ensemble points; inside a segment only the drafter decodes. So a segment is produced when
    (1) each of the drafter's tokens in it is the drafter's argmax (it drafts the segment), and
    (2) at the segment start ``consensus(first-token log-probs, first-token-is-argmax flags)``
    (both in member order) holds, i.e. SAFE skips ensembling there (rule (a)/(b) of docs/algorithm.md,
    Consensus); by Theorem 1 the mean aggregate would pick the drafter's token anyway, so the flag is
    also sound for the ``aligned`` schedule. Without ``consensus`` every member's first token must be its argmax (rule
    (a)). With one member this is lm-eval's own rule: every token is its argmax.
    """
    if len(scores) == 1:
        return sum(scores[0].logprobs), all(scores[0].greedy)
    segments = Segments.of(scores, text, drafter)
    total, is_greedy = 0.0, True
    for s, value in enumerate(segments.ensemble(weights, how)):
        total += value
        if is_greedy:
            lps = [lp if lp is not None else 0.0 for lp in (f[s] for f in segments.first_logprobs)]
            flags = [f[s] for f in segments.first_greedy]
            agreed = consensus(lps, flags) if consensus else all(flags)
            is_greedy = segments.drafted[s] and agreed
    return total, is_greedy


def greedy_rule(
    weights: list[float], drafter: int, schedule: str = "safe", aggregator: str = "unite"
) -> Callable[[list[float], list[bool]], bool]:
    """SAFE's skip rule at a segment start, as the decoder applies it at an aligned position
    (:func:`~lm_eval_safe.ensemble.consensus.consensus`, members in their own order): with ``gac`` also
    GaC's gate (drafter's probability >= 0.5); with ``schedule=drafter`` the drafter alone
    decides."""

    def rule(first_lps: list[float], first_greedy: list[bool]) -> bool:
        if schedule == "drafter":
            return True
        if aggregator == "gac" and math.exp(first_lps[drafter]) >= GAC_GATE:
            return True
        verifiers_agree = [g for m, g in enumerate(first_greedy) if m != drafter]
        return consensus(verifiers_agree, [math.exp(lp) for lp in first_lps], weights)

    return rule


def score_loglikelihood(
    members: Sequence[Member],
    options: SafeOptions,
    drafter: int,
    args: list[tuple[str, str]],
    labels: list[str],
    disable_tqdm: bool = False,
) -> list[tuple[float, bool]]:
    """``(log P(continuation | context), is_greedy)`` per ``(context, continuation)``: each
    member scores every request (contexts shared by several choices run once per member), then
    segment probabilities are aggregated at common boundaries. ``labels`` name the requests in
    errors (``<task> doc <id>``)."""
    weights = options.member_weights(len(members))
    rule = greedy_rule(weights, drafter, options.schedule, options.aggregator)
    return [
        combine(scores, weights, options.ll_aggregate, scored, drafter, rule)
        for scored, scores in _member_scores(members, options, args, labels, disable_tqdm)
    ]


def score_segments(
    members: Sequence[Member], options: SafeOptions, context: str, continuation: str
) -> list[tuple[str, float]]:
    """The continuation cut at every member's common token boundaries, each piece with the
    ensemble's log-probability of it given the context and the pieces before it (what the
    server reports as ``logprobs``; they sum to :func:`score_loglikelihood`'s score). A context
    ending in spaces lends them to the continuation, as lm-eval's tokenization of a pair does:
    the first piece's log-prob covers them, its text does not."""
    ((scored, scores),) = _member_scores(members, options, [(context, continuation)], ["logprobs"], True)
    if len(scores) == 1 and scores[0].ends is not None:
        cuts, values = scores[0].ends, scores[0].logprobs
    elif len(scores) == 1:  # its tokens do not spell the text: one piece
        cuts, values = [len(scored)], [sum(scores[0].logprobs)]
    else:
        segments = Segments.of(scores, scored)
        cuts, values = segments.cuts, segments.ensemble(options.member_weights(len(members)), options.ll_aggregate)
    # a context's trailing spaces, lent to the continuation, are the context's text: cut from
    # the first piece (a piece of nothing else gives its log-prob to the next)
    start = len(scored) - len(continuation.encode("utf-8"))
    pieces: list[tuple[str, float]] = []
    carried = 0.0
    for end, value in zip(cuts, values, strict=True):
        if end <= start:
            carried += value
            continue
        pieces.append((scored[start:end].decode("utf-8", errors="replace"), value + carried))
        start, carried = end, 0.0
    return pieces


def _encoded(
    member: Member, context: str, continuation: str, label: str
) -> tuple[list[int], list[int], str]:
    """:func:`~lm_eval_safe.scoring.pairs.encode_pair`, with a text no tokenizer encodes (a lone
    surrogate) named by its document."""
    try:
        return encode_pair(member, context, continuation)
    except RequestError as exc:
        raise RequestError(f"{label}: {exc}") from exc


def _member_scores(
    members: Sequence[Member],
    options: SafeOptions,
    args: list[tuple[str, str]],
    labels: list[str],
    disable_tqdm: bool,
) -> list[tuple[bytes, list[MemberScore]]]:
    """Per request, the scored continuation's bytes and each member's :class:`MemberScore`."""
    for i, (context, continuation) in enumerate(args):
        if continuation == "":
            raise RequestError(
                f"{labels[i]}: loglikelihood request "
                f"{(context[-60:], continuation)!r}: empty continuation, nothing to score"
            )
    encoded = [[_encoded(m, c, x, labels[i]) for i, (c, x) in enumerate(args)] for m in members]
    per_member = score_members(
        members,
        [[(ctx, cont) for ctx, cont, _ in enc] for enc in encoded],
        options,
        kind="loglikelihood",
        labels=[(c[-60:], x) for c, x in args],
        disable_tqdm=disable_tqdm,
    )
    results = []
    for i, (_, continuation) in enumerate(args):
        texts = [enc[i][2] for enc in encoded]
        same = all(t == texts[0] for t in texts)
        scored = (texts[0] if same else continuation).encode("utf-8")
        scores = []
        for enc, member, tokens in zip(encoded, members, per_member, strict=True):
            ends = member.vocab.token_ends(enc[i][1], enc[i][2].encode("utf-8"))
            if ends is not None and not same:  # chat contexts: measure from the continuation
                shift = len(enc[i][2].encode("utf-8")) - len(scored)
                ends = [max(0, e - shift) for e in ends]
            scores.append(MemberScore(tokens[i][0], tokens[i][1], ends))
        results.append((scored, scores))
    return results


def score_rolling(
    members: Sequence[Member], options: SafeOptions, texts: list[str], disable_tqdm: bool = False
) -> list[float]:
    """Perplexity: each member scores the whole text with its own rolling windows (as lm-eval's
    backend for its engine: ``hf`` windows of max_length, ``vllm`` of max_length - 2; its
    BOS/EOS prefix token, context_len=1); the members' per-token log-probs are then combined at
    common boundaries like a loglikelihood continuation."""
    token_ids = [[m.encode(text) for text in texts] for m in members]
    all_pairs: list[list[tuple[list[int], list[int]]]] = []
    owners: list[list[int]] = []  # per member: the text each of its windows belongs to
    for member, ids_of in zip(members, token_ids, strict=True):
        pairs, owner = [], []
        for i, ids in enumerate(ids_of):
            for ctx, pred in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=ids,
                    prefix_token=member.prefix_token_id,
                    max_seq_len=member.engine.rolling_window,
                    context_len=1,
                ),
            ):
                pairs.append((ctx, pred))
                owner.append(i)
        all_pairs.append(pairs)
        owners.append(owner)
    per_member = score_members(
        members,
        all_pairs,
        options,
        kind="loglikelihood_rolling",
        labels=[t[:60] for t in texts],
        disable_tqdm=disable_tqdm,
    )
    weights = options.member_weights(len(members))
    scores: list[list[MemberScore]] = [[] for _ in texts]
    for member, ids_of, tokens, owner in zip(members, token_ids, per_member, owners, strict=True):
        lps: list[list[float]] = [[] for _ in texts]
        greedy: list[list[bool]] = [[] for _ in texts]
        for i, (lp, g) in zip(owner, tokens, strict=True):
            lps[i].extend(lp)
            greedy[i].extend(g)
        for i, text in enumerate(texts):
            ends = member.vocab.token_ends(ids_of[i], text.encode("utf-8"))
            scores[i].append(MemberScore(lps[i], greedy[i], ends))
    return [
        float(combine(member_scores, weights, options.ll_aggregate, text.encode("utf-8"))[0])
        for text, member_scores in zip(texts, scores, strict=True)
    ]
