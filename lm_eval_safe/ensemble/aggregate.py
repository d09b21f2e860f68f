"""Aggregators ("method X" of the paper) and probability sharpening.

An aggregator turns the members' next-token distributions at one ensemble point into one
chosen token *string* (bytes); the decoder converts it back to drafter ids. ``gac`` averages
full distributions over a union vocabulary; ``unite`` averages over the union of each
member's top-k strings. Sharpening (docs/algorithm.md, Sharpening) moves mass smeared over sub-word variants
of one word ("The", "Th", "T") onto the shortest variant the drafter itself ranks high.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm_eval_safe.disk_cache import cached_blob
from lm_eval_safe.members.vocabulary import TokenVocabulary, key_text

logger = logging.getLogger(__name__)

SHARPEN_THRESHOLD = 0.5  # sharpen only when the aggregate's maximum is below this
#: In the union-vocabulary cache file name: 2 = checksummed blob (lm_eval_safe.disk_cache), so
#: the plain torch files of earlier versions sharing the cache folder are left alone.
UNION_CACHE_FORMAT = 2


@dataclass
class View:
    """One member's next-token distribution at an ensemble point. The functions here need the
    full log-softmax; a head only (an engine's ``TopLogprobs``) goes through
    :mod:`lm_eval_safe.ensemble.certified` first."""

    logprobs: Any  # Row: [len(vocab)] log-softmax over the tokenizer's ids, or a TopLogprobs
    vocab: TokenVocabulary
    tokenizer: Any
    weight: float = 1.0


@dataclass
class Choice:
    key: bytes
    probability: float
    sharpened: bool
    #: the drafter's ids for ``key`` where the rule that chose it also says how to write it
    #: (``reference=authors``); None: :meth:`~lm_eval_safe.ensemble.ensembler.Ensembler.to_drafter_ids`
    drafter_ids: list[int] | None = None


class UnionVocabulary:
    """Union of several tokenizers' normalised token strings, with one id map per member.

    Built once per member set (seconds for 150k-260k vocabularies) and cached on disk keyed by
    the tokenizers' fingerprints, since it depends on nothing else.
    """

    def __init__(self, keys: list[bytes], maps: list[torch.Tensor]):
        self.keys = keys
        self.maps = maps  # per member: LongTensor [len(vocab_m)] -> union index

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def build(cls, vocabs: list[TokenVocabulary], cache_dir: Path | None = None) -> UnionVocabulary:
        """The union of ``vocabs``; with ``cache_dir``, read from or stored in its crash-safe
        cache (a damaged file is rebuilt with a warning, see :mod:`lm_eval_safe.disk_cache`)."""
        if cache_dir is None:
            return cls._compute(vocabs)
        name = "-".join(v.fingerprint for v in vocabs) + f".v{UNION_CACHE_FORMAT}.pt"
        path = cache_dir / "union-vocab" / name
        computed: list[UnionVocabulary] = []

        def build() -> bytes:
            union = cls._compute(vocabs)
            computed.append(union)
            flat, offsets = _pack(union.keys)
            buffer = io.BytesIO()
            torch.save({"keys": flat, "offsets": offsets, "maps": union.maps}, buffer)
            return buffer.getvalue()

        payload = cached_blob(path, build, "union vocabulary")
        if computed:
            return computed[0]
        data = torch.load(io.BytesIO(payload), weights_only=True)
        return cls([bytes(k) for k in _unpack(data["keys"], data["offsets"])], list(data["maps"]))

    @classmethod
    def _compute(cls, vocabs: list[TokenVocabulary]) -> UnionVocabulary:
        index: dict[bytes, int] = {}
        keys: list[bytes] = []
        maps = []
        for vocab in vocabs:
            ids = []
            for key in vocab.keys:
                slot = index.get(key)
                if slot is None:
                    slot = index[key] = len(keys)
                    keys.append(key)
                ids.append(slot)
            maps.append(torch.tensor(ids, dtype=torch.long))
        return cls(keys, maps)


def _pack(keys: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(k) for k in keys], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    flat = (
        torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8)
        if keys
        else torch.zeros(0, dtype=torch.uint8)
    )
    return flat.clone(), offsets


def _unpack(flat: torch.Tensor, offsets: torch.Tensor) -> list[bytes]:
    raw = flat.numpy().tobytes()
    bounds = offsets.tolist()
    return [raw[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


def normalised_weights(views: Sequence[View]) -> list[float]:
    total = sum(v.weight for v in views)
    return [v.weight / total for v in views]


def weights_used(weights: Sequence[float]) -> list[int]:
    """The members a weighted geometric mean reads: those of weight above 0."""
    return [m for m, w in enumerate(weights) if w > 0]


def _can_absorb(key: bytes, probability: float, lam: float) -> bool:
    """Whether a drafter top-k string may take the mass of the strings extending it (docs/algorithm.md, Sharpening)."""
    return probability > lam and key.strip() != b"" and not key.startswith(b"\x00")


def _sharpen(
    scores: dict[bytes, float], drafter_top: list[bytes], candidates: list[bytes], lam: float
) -> dict[bytes, float]:
    """Heuristic sharpening: a drafter top-k string absorbs the mass of candidates it prefixes."""
    sharpened = dict(scores)
    for s in drafter_top:
        if s not in scores or not _can_absorb(s, scores[s], lam):
            continue
        sharpened[s] = scores[s] + sum(
            scores.get(c, 0.0) for c in candidates if c != s and c.startswith(s)
        )
    return sharpened


def top_ids(row: torch.Tensor, k: int) -> list[int]:
    """The ``k`` most probable ids of a full row, best first, equal values in the order of
    their ids (the first of equal maxima first, as ``torch.argmax``). ``torch.topk`` lists equal
    values in whatever order its kernel meets them, so a tie at the k-th place would make the
    top-k strings (UniTE's candidates, sharpening's) one set or another."""
    k = min(k, row.numel())
    kth = torch.topk(row, k).values[-1]
    above = torch.nonzero(row > kth).flatten()
    tied = torch.nonzero(row == kth).flatten()[: k - above.numel()]
    ids = torch.cat([above, tied]).tolist()
    values = row[ids].tolist()
    return [i for _, i in sorted(zip(values, ids, strict=True), key=lambda pair: (-pair[0], pair[1]))]


def _top_keys(view: View, k: int) -> list[bytes]:
    return [view.vocab.keys[i] for i in top_ids(view.logprobs, k)]


def _gac_log_geometric(
    views: list[View], weights: list[float], maps: list[torch.Tensor], size: int
) -> torch.Tensor:
    """Weighted log-mean of the members' probabilities over the union (-inf where one lacks it).
    A member of weight 0 takes no part, also where it lacks a string (``p ** 0 = 1``, where
    ``0 * log 0`` would be NaN, which ``argmax`` would pick)."""
    total = torch.zeros(size, dtype=torch.float64)
    for view, weight, mapping in zip(views, weights, maps, strict=True):
        if weight == 0:
            continue
        probs = torch.zeros(size, dtype=torch.float64)
        probs.scatter_add_(0, mapping, view.logprobs.double().exp())
        total += weight * probs.log()  # -inf where the member lacks the string
    return total


def _gac_mixture(views: list[View], weights: list[float], union: UnionVocabulary) -> torch.Tensor:
    """Weighted mean of the members' probabilities over the union vocabulary (GaC)."""
    total = torch.zeros(len(union), dtype=torch.float64)
    for view, weight, mapping in zip(views, weights, union.maps, strict=True):
        total.scatter_add_(0, mapping, weight * view.logprobs.double().exp())
    return total


def _gac_candidate_ids(views: list[View], union: UnionVocabulary, top_k: int) -> list[int]:
    """Union indices of every member's top-k strings: the strings sharpening looks at."""
    candidate_ids: list[int] = []
    for view, mapping in zip(views, union.maps, strict=True):
        candidate_ids.extend(mapping[top_ids(view.logprobs, top_k)].tolist())
    return candidate_ids


def _geometric_choice(log_total: torch.Tensor, keys: Sequence[bytes], choice: Choice) -> Choice:
    """Geometric sharpening's pick: the weighted geometric mean's most probable string (its
    value unnormalised, as the argmax needs none). Where no string has a finite mean (the
    members share none), the mean cannot rank anything and the mixture's choice stands."""
    if not bool(torch.isfinite(log_total).any()):
        return choice
    best = int(torch.argmax(log_total))
    return Choice(keys[best], math.exp(float(log_total[best])), True)


def gac(views: list[View], union: UnionVocabulary, sharpen: str, lam: float, top_k: int) -> Choice:
    """Average full distributions in the union vocabulary (GaC), sharpened when the mixture's
    maximum is below 0.5: heuristic absorption, or the weighted geometric mean instead."""
    weights = normalised_weights(views)
    total = _gac_mixture(views, weights, union)
    best = int(torch.argmax(total))
    choice = Choice(union.keys[best], float(total[best]), False)
    if sharpen == "geometric" and choice.probability < SHARPEN_THRESHOLD:
        return _geometric_choice(_gac_log_geometric(views, weights, union.maps, len(union)), union.keys, choice)
    if sharpen == "heuristic" and choice.probability < SHARPEN_THRESHOLD:
        candidate_ids = _gac_candidate_ids(views, union, top_k)
        candidates = list(dict.fromkeys(union.keys[i] for i in candidate_ids))
        scores = {union.keys[i]: float(total[i]) for i in set(candidate_ids)}
        sharpened = _sharpen(scores, _top_keys(views[0], top_k), candidates, lam)
        key = max(sharpened, key=lambda k: sharpened[k])
        if sharpened[key] > choice.probability:
            choice = Choice(key, sharpened[key], True)
    return choice


def member_token_for(view: View, key: bytes) -> int | None:
    """The id UniTE reads a member's probability of a string from: its own token for the
    string, else the first token of its encoding of it (None: it cannot spell the string)."""
    token_id = view.vocab.lookup.get(key)
    if token_id is not None:
        return token_id
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    ids = view.vocab.encode_text(view.tokenizer, text)
    return ids[0] if ids else None


def _member_logits_for(view: View, keys: list[bytes]) -> list[float]:
    """A member's log-probability of each string: its own token, else its first token of the
    string (-inf where it cannot spell it). A full row answers every id with one index."""
    ids = [member_token_for(view, key) for key in keys]
    known = [token_id for token_id in ids if token_id is not None]
    row = view.logprobs
    if isinstance(row, torch.Tensor):
        found = iter(row[known].tolist() if known else [])
    else:
        found = iter(float(row[token_id]) for token_id in known)
    return [float("-inf") if token_id is None else next(found) for token_id in ids]


def _unite_table(views: list[View], top_k: int) -> tuple[list[bytes], torch.Tensor]:
    """UniTE's candidate strings (union of each member's top-k) and each member's log-softmax
    over exactly those strings (rows: members)."""
    union_keys = list(dict.fromkeys(k for view in views for k in _top_keys(view, top_k)))
    matrix = torch.tensor([_member_logits_for(view, union_keys) for view in views], dtype=torch.float64)
    return union_keys, torch.log_softmax(matrix, dim=-1)


def unite(views: list[View], sharpen: str, lam: float, top_k: int) -> Choice:
    """UniTE: softmax of each member over the union of top-k strings, then average (sharpened
    as :func:`gac` is)."""
    weights = normalised_weights(views)
    union_keys, member_logq = _unite_table(views, top_k)
    w = torch.tensor(weights, dtype=torch.float64).unsqueeze(1)
    total = (w * member_logq.exp()).sum(0)
    best = int(torch.argmax(total))
    choice = Choice(union_keys[best], float(total[best]), False)
    if sharpen == "geometric" and choice.probability < SHARPEN_THRESHOLD:
        # a member of weight 0 takes no part (0 * -inf, a string it cannot spell, is NaN)
        return _geometric_choice((w * member_logq)[weights_used(weights)].sum(0), union_keys, choice)
    if sharpen == "heuristic" and choice.probability < SHARPEN_THRESHOLD:
        scores = {k: float(p) for k, p in zip(union_keys, total.tolist(), strict=True)}
        sharpened = _sharpen(scores, _top_keys(views[0], top_k), union_keys, lam)
        key = max(sharpened, key=lambda k: sharpened[k])
        if sharpened[key] > choice.probability:
            choice = Choice(key, sharpened[key], True)
    return choice


# -- the same aggregates as distributions, for sampling --------------------------------------


@dataclass
class StringDistribution:
    """An aggregate as a distribution over strings: ``probs[i]`` is the probability of
    ``keys[i]`` (normalised; all zero when the members share no string at all)."""

    keys: Sequence[bytes]
    probs: torch.Tensor  # float64
    sharpened: bool = False


def _geometric_distribution(
    log_total: torch.Tensor, keys: Sequence[bytes], mixture: torch.Tensor
) -> StringDistribution:
    """Geometric sharpening as a distribution: ``exp(log_total)`` normalised to sum 1 (a
    weighted geometric mean has less mass); the mixture where no string has a finite mean, as
    :func:`_geometric_choice` keeps the mixture's choice there."""
    if not bool(torch.isfinite(log_total).any()):
        return StringDistribution(keys, mixture)
    return StringDistribution(keys, torch.softmax(log_total, dim=-1), True)


def _absorb(
    probs: torch.Tensor, candidates: dict[bytes, int], drafter_top: list[bytes], lam: float
) -> tuple[torch.Tensor, bool]:
    """Heuristic sharpening as a distribution (the greedy :func:`_sharpen` only needs an argmax
    and adds mass without taking it anywhere): every candidate string that extends an absorbing
    string (a drafter top-k string with probability > ``lam``) *moves* its probability to the
    shortest absorbing string it extends. Mass is conserved, so the result is normalised; for
    the shortest absorbing strings it equals what :func:`_sharpen` scores them."""
    absorbers = [
        s
        for s in dict.fromkeys(drafter_top)
        if s in candidates and _can_absorb(s, float(probs[candidates[s]]), lam)
    ]
    moved = probs.clone()
    changed = False
    for key, index in candidates.items():
        prefixes = [a for a in absorbers if a != key and key.startswith(a)]
        if prefixes and float(probs[index]) > 0.0:
            target = candidates[min(prefixes, key=len)]
            moved[target] += probs[index]
            moved[index] -= probs[index]
            changed = True
    return moved, changed


def gac_distribution(
    views: list[View], union: UnionVocabulary, sharpen: str, lam: float, top_k: int
) -> StringDistribution:
    """What :func:`gac` takes the argmax of, as a distribution over ``union.keys``: the weighted
    mixture, or when the mixture's maximum is below 0.5 its heuristic sharpening or the
    normalised weighted geometric mean. Members with weight 0 take no part (``p ** 0 = 1``)."""
    weights = normalised_weights(views)
    total = _gac_mixture(views, weights, union)
    if sharpen == "geometric" and float(total.max()) < SHARPEN_THRESHOLD:
        log_total = _gac_log_geometric(views, weights, union.maps, len(union))
        return _geometric_distribution(log_total, union.keys, total)
    if sharpen == "heuristic" and float(total.max()) < SHARPEN_THRESHOLD:
        candidate_ids = dict.fromkeys(_gac_candidate_ids(views, union, top_k))
        candidates = {union.keys[i]: i for i in candidate_ids}
        total, changed = _absorb(total, candidates, _top_keys(views[0], top_k), lam)
        return StringDistribution(union.keys, total, changed)
    return StringDistribution(union.keys, total)


def unite_distribution(
    views: list[View], sharpen: str, lam: float, top_k: int
) -> StringDistribution:
    """What :func:`unite` takes the argmax of, as a distribution over its candidate strings
    (zero for every other string). A member with no finite log-probability on the candidates
    (its sampling filter removed them all) takes no part."""
    weights = torch.tensor(normalised_weights(views), dtype=torch.float64)
    union_keys, member_logq = _unite_table(views, top_k)
    usable = torch.isfinite(member_logq).any(dim=1) & (weights > 0)
    if not bool(usable.any()):
        return StringDistribution(union_keys, torch.zeros(len(union_keys), dtype=torch.float64))
    w = (weights[usable] / weights[usable].sum()).unsqueeze(1)
    logq = member_logq[usable]
    total = (w * logq.exp()).sum(0)
    if sharpen == "geometric" and float(total.max()) < SHARPEN_THRESHOLD:
        return _geometric_distribution((w * logq).sum(0), union_keys, total)
    if sharpen == "heuristic" and float(total.max()) < SHARPEN_THRESHOLD:
        candidates = {k: i for i, k in enumerate(union_keys)}
        total, changed = _absorb(total, candidates, _top_keys(views[0], top_k), lam)
        return StringDistribution(union_keys, total, changed)
    return StringDistribution(union_keys, total)


#: Candidates shown per member and for the ensemble at each point.
TOP_CANDIDATES = 5

def top_candidates(keys: Any, probs: torch.Tensor, k: int = TOP_CANDIDATES) -> list[list[Any]]:
    """The ``k`` most probable strings as ``[text, probability]`` pairs, best first."""
    values, indices = torch.topk(probs, min(k, int(probs.numel())))
    return [[key_text(keys[int(i)]), round(float(v), 6)] for v, i in zip(values, indices, strict=True)]
