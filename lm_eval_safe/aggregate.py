"""Aggregators ("method X" of the paper) and probability sharpening.

An aggregator turns the members' next-token distributions at one ensemble point into one
chosen token *string* (bytes); the decoder converts it back to drafter ids. ``gac`` averages
full distributions over a union vocabulary; ``unite`` averages over the union of each
member's top-k strings. Sharpening (SAFE_SPEC §5) moves mass smeared over sub-word variants
of one word ("The", "Th", "T") onto the shortest variant the drafter itself ranks high.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm_eval_safe.disk_cache import cached_blob
from lm_eval_safe.vocabulary import TokenVocabulary

logger = logging.getLogger(__name__)

SHARPEN_THRESHOLD = 0.5  # sharpen only when the aggregate's maximum is below this
#: In the union-vocabulary cache file name: 2 = checksummed blob (lm_eval_safe.disk_cache), so
#: the plain torch files of earlier versions sharing the cache folder are left alone.
UNION_CACHE_FORMAT = 2


@dataclass
class View:
    """One member's next-token distribution at an ensemble point."""

    logprobs: torch.Tensor  # [len(vocab)] log-softmax over the tokenizer's ids (no padding rows)
    vocab: TokenVocabulary
    tokenizer: Any
    weight: float = 1.0


@dataclass
class Choice:
    key: bytes
    probability: float
    sharpened: bool


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


def _normalised_weights(views: list[View]) -> list[float]:
    total = sum(v.weight for v in views)
    return [v.weight / total for v in views]


def _sharpen(
    scores: dict[bytes, float], drafter_top: list[bytes], candidates: list[bytes], lam: float
) -> dict[bytes, float]:
    """Heuristic sharpening: a drafter top-k string absorbs the mass of candidates it prefixes."""
    sharpened = dict(scores)
    for s in drafter_top:
        if s not in scores or scores[s] <= lam or s.strip() == b"" or s.startswith(b"\x00"):
            continue
        sharpened[s] = scores[s] + sum(
            scores.get(c, 0.0) for c in candidates if c != s and c.startswith(s)
        )
    return sharpened


def _top_keys(view: View, k: int) -> list[bytes]:
    top = torch.topk(view.logprobs, min(k, view.logprobs.shape[-1])).indices.tolist()
    return [view.vocab.keys[i] for i in top]


def gac(views: list[View], union: UnionVocabulary, sharpen: str, lam: float, top_k: int) -> Choice:
    """Average full distributions in the union vocabulary (GaC); geometric = weighted log-mean."""
    weights = _normalised_weights(views)
    if sharpen == "geometric":
        total = torch.zeros(len(union), dtype=torch.float64)
        for view, weight, mapping in zip(views, weights, union.maps, strict=True):
            probs = torch.zeros(len(union), dtype=torch.float64)
            probs.scatter_add_(0, mapping, view.logprobs.double().exp())
            total += weight * probs.log()  # -inf where the member lacks the string
        best = int(torch.argmax(total))
        return Choice(union.keys[best], math.exp(float(total[best])), False)
    total = torch.zeros(len(union), dtype=torch.float64)
    for view, weight, mapping in zip(views, weights, union.maps, strict=True):
        total.scatter_add_(0, mapping, weight * view.logprobs.double().exp())
    best = int(torch.argmax(total))
    choice = Choice(union.keys[best], float(total[best]), False)
    if sharpen == "heuristic" and choice.probability < SHARPEN_THRESHOLD:
        candidate_ids: list[int] = []
        for view, mapping in zip(views, union.maps, strict=True):
            top = torch.topk(view.logprobs, min(top_k, view.logprobs.shape[-1])).indices
            candidate_ids.extend(mapping[top].tolist())
        candidates = list(dict.fromkeys(union.keys[i] for i in candidate_ids))
        scores = {union.keys[i]: float(total[i]) for i in set(candidate_ids)}
        sharpened = _sharpen(scores, _top_keys(views[0], top_k), candidates, lam)
        key = max(sharpened, key=lambda k: sharpened[k])
        if sharpened[key] > choice.probability:
            choice = Choice(key, sharpened[key], True)
    return choice


def _member_logit_for(view: View, key: bytes) -> float:
    """A member's log-probability of a string: its own token, else its first token of the string."""
    token_id = view.vocab.lookup.get(key)
    if token_id is None:
        try:
            text = key.decode("utf-8")
        except UnicodeDecodeError:
            return float("-inf")
        ids = view.vocab.encode_text(view.tokenizer, text)
        if not ids:
            return float("-inf")
        token_id = ids[0]
    return float(view.logprobs[token_id])


def unite(views: list[View], sharpen: str, lam: float, top_k: int) -> Choice:
    """UniTE: softmax of each member over the union of top-k strings, then average."""
    weights = _normalised_weights(views)
    union_keys = list(dict.fromkeys(k for view in views for k in _top_keys(view, top_k)))
    matrix = torch.tensor(
        [[_member_logit_for(view, key) for key in union_keys] for view in views],
        dtype=torch.float64,
    )
    member_logq = torch.log_softmax(matrix, dim=-1)
    w = torch.tensor(weights, dtype=torch.float64).unsqueeze(1)
    if sharpen == "geometric":
        total = (w * member_logq).sum(0)
        best = int(torch.argmax(total))
        return Choice(union_keys[best], math.exp(float(total[best])), False)
    total = (w * member_logq.exp()).sum(0)
    best = int(torch.argmax(total))
    choice = Choice(union_keys[best], float(total[best]), False)
    if sharpen == "heuristic" and choice.probability < SHARPEN_THRESHOLD:
        scores = {k: float(p) for k, p in zip(union_keys, total.tolist(), strict=True)}
        sharpened = _sharpen(scores, _top_keys(views[0], top_k), union_keys, lam)
        key = max(sharpened, key=lambda k: sharpened[k])
        if sharpened[key] > choice.probability:
            choice = Choice(key, sharpened[key], True)
    return choice
