"""UniTE and GaC as the SAFE authors' code computes them (``reference=authors``;
docs/algorithm.md, The authors' code).

Where :mod:`lm_eval_safe.ensemble.aggregate` compares token strings as bytes, their code compares
Python strings, and makes them differently per aggregator:

- **UniTE** keys each member's top-k ids by ``tokenizer.decode(id)``: two ids that decode alike
  keep one entry (the later one's value and id), each member's EOS is its own string
  (``<|im_end|>``, ``<eos>``), and a member lacking a string is read at the id of
  ``tokenize(string)`` when that is one token, else at its first sub-token that is not the
  tokenizer's blank (``encode(" ")``). The chosen string becomes the drafter's id for it
  (its own, or that sub-token), or the drafter's EOS when the verifier's id for it decodes to an
  EOS name.
- **GaC** builds its union from ``get_vocab()``'s raw strings: ``Ġ`` and ``Ċ`` replaced by a
  space and a newline in byte-level vocabularies (the rest of the GPT-2 byte map is not
  undone), ``▁`` by a space in SentencePiece ones, the byte tokens ``<0x00>``-``<0xFF>`` as
  those names (a byte-level vocabulary's first 128 bytes too, except digits and letters when
  the other member is not byte-level). The chosen string is always encoded again, after a
  prefix the tokenizer keeps apart (:func:`special_prefix`), whatever was drafted.
- **Sharpening** (both): below 0.5, the geometric mean of the two members, or the heuristic
  with only ``" "`` barred from absorbing.

Ties between equal scores go to the first string in the drafter's order (their code breaks
them in the order of a Python ``set``, which changes from process to process).
"""

from __future__ import annotations

from typing import Any

import torch

from lm_eval_safe.ensemble.aggregate import SHARPEN_THRESHOLD, Choice, View, top_candidates
from lm_eval_safe.ensemble.aggregator import Aggregator
from lm_eval_safe.ensemble.authors.union import AuthorsUnion, special_prefix
from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.member import Member
from lm_eval_safe.options import SafeOptions

#: Strings the authors' code takes as "stop" besides each tokenizer's own EOS.
UNITE_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "<|end|>", "</s>")
GAC_EOS_NAMES = UNITE_EOS_NAMES[:4]


def _blank_id(tokenizer: Any) -> int:
    return tokenizer.encode(" ", add_special_tokens=False)[0]


def _top_table(view: View, k: int) -> dict[str, tuple[float, int]]:
    """A member's top-k ids as ``{decode(id): (log-prob, id)}``, best first; an id decoding like
    an earlier one replaces its value and id but not its place."""
    values, ids = torch.topk(view.logprobs.float(), k)
    table: dict[str, tuple[float, int]] = {}
    for value, token in zip(values.tolist(), ids.tolist(), strict=True):
        table[view.tokenizer.decode([token])] = (value, token)
    return table


def _read_at(view: View, key: str, blank: int) -> tuple[float, int]:
    """Where a member lacking ``key`` among its top-k is read: its single token for it, else
    the first sub-token that is not blank (blank itself when every sub-token is: their code has
    no value there)."""
    token = blank
    if key != "":
        found = view.tokenizer.convert_tokens_to_ids(view.tokenizer.tokenize(key))
        token = found[0] if len(found) == 1 else next((t for t in found if t != blank), blank)
    return float(view.logprobs[token]), token


def _sharpened(order: list[str], mixture: torch.Tensor, drafter_top: list[str], lam: float) -> torch.Tensor:
    """The authors' heuristic, in their float32 arithmetic and order: each drafter top-k string
    above ``lam`` (but ``" "``) adds the unsharpened score of every other string it prefixes."""
    out = mixture.clone()
    for index, key in enumerate(order):
        if key == " " or key not in drafter_top or not float(mixture[index]) > lam:
            continue
        for other, other_key in enumerate(order):
            if other != index and other_key.startswith(key):
                out[index] = out[index] + float(mixture[other])
    return out


class AuthorsUnite(Aggregator):
    """The authors' ``safe_generate_unite`` decision at an ensemble point. Their code reads
    full distributions and decodes greedily: it certifies nothing from engine heads (the
    interface's default) and has no sampled rule (:meth:`Aggregator.target` refuses)."""

    def __init__(self, drafter: Member, verifier: Member, sharpen: str, lam: float, top_k: int):
        self.drafter, self.verifier = drafter, verifier
        self.sharpen, self.lam, self.top_k = sharpen, lam, top_k
        self.eos_names = {drafter.tokenizer.eos_token, verifier.tokenizer.eos_token, *UNITE_EOS_NAMES}
        self.blanks = [_blank_id(m.tokenizer) for m in (drafter, verifier)]

    @classmethod
    def from_options(cls, drafter: Member, verifiers: list[Member], options: SafeOptions) -> AuthorsUnite:
        """For the drafter and the one verifier ``reference=authors`` allows."""
        return cls(drafter, verifiers[0], options.sharpen, options.sharpen_lambda, options.top_k)

    def table(self, views: list[View]) -> tuple[list[str], torch.Tensor, list[list[int]], bool]:
        """The candidate strings in the drafter's order, their scores (the mixture, or its
        sharpening; float32, as their code computes), each member's id for each string, and
        whether sharpening decided."""
        tops = [_top_table(view, self.top_k) for view in views]
        order = list(dict.fromkeys([*tops[0], *tops[1]]))
        probs, ids = [], []
        for view, top, blank in zip(views, tops, self.blanks, strict=True):
            entries = [top[key] if key in top else _read_at(view, key, blank) for key in order]
            probs.append(torch.softmax(torch.tensor([v for v, _ in entries]), dim=0))
            ids.append([t for _, t in entries])
        mixture = 0.5 * probs[0] + 0.5 * probs[1]
        if float(mixture.max()) >= SHARPEN_THRESHOLD or self.sharpen == "none":
            return order, mixture, ids, False
        if self.sharpen == "geometric":
            return order, torch.sqrt(probs[0] * probs[1]), ids, True
        return order, _sharpened(order, mixture, list(tops[0]), self.lam), ids, True

    def choose(self, views: list[View]) -> Choice:
        order, scores, ids, sharpened = self.table(views)
        best = int(torch.argmax(scores))  # the first of equal maxima
        drafter_id, verifier_id = ids[0][best], ids[1][best]
        if self.verifier.tokenizer.decode([verifier_id]) in self.eos_names:
            drafter_id = self.drafter.eos_id
        return Choice(order[best].encode("utf-8"), float(scores[best]), sharpened, [drafter_id])

    def candidates(self, views: list[View]) -> list[list[Any]]:
        """Their scores at a point (their strings, sharpened where it decided), best first."""
        order, scores, _, _ = self.table(views)
        return top_candidates([k.encode("utf-8") for k in order], scores)

    def written_ids(self, encoded: list[int]) -> list[int]:
        """Never asked (:meth:`choose` names the drafter's id); one id, as their code writes."""
        return encoded[:1]


class AuthorsGac(Aggregator):
    """The authors' ``safe_generate_gac`` decision at an ensemble point, over their union; like
    :class:`AuthorsUnite`, full distributions only and greedy only."""

    def __init__(self, drafter: Member, verifier: Member, sharpen: str, lam: float, top_k: int):
        self.drafter = drafter
        self.sharpen, self.lam, self.top_k = sharpen, lam, top_k
        self.union = AuthorsUnion.build([drafter, verifier])
        self.prefix = special_prefix(drafter.tokenizer)
        self.eos_names = {drafter.tokenizer.eos_token, verifier.tokenizer.eos_token, *GAC_EOS_NAMES}

    @classmethod
    def from_options(cls, drafter: Member, verifiers: list[Member], options: SafeOptions) -> AuthorsGac:
        """For the drafter and the one verifier ``reference=authors`` allows. The union is built
        now, so a tokenizer their code refuses fails before the first request."""
        try:
            return cls(drafter, verifiers[0], options.sharpen, options.sharpen_lambda, options.top_k)
        except ValueError as exc:
            raise OptionError(f"reference=authors with aggregator=gac: {exc}; use reference=paper") from exc

    def table(self, views: list[View]) -> tuple[torch.Tensor, bool]:
        """The union's scores (the members' mean, or its sharpening; their code sums the two
        members, which ranks alike) and whether sharpening decided."""
        mapped = [self.union.project(m, view.logprobs) for m, view in enumerate(views)]
        merged = mapped[0] + mapped[1]
        if float(merged.max()) >= 2 * SHARPEN_THRESHOLD or self.sharpen == "none":
            return merged / 2, False
        if self.sharpen == "geometric":
            return torch.sqrt(mapped[0] * mapped[1]), True
        tops = [set(torch.topk(m, self.top_k).indices.tolist()) for m in mapped]
        candidates = tops[0] | tops[1]
        keys = self.union.keys
        sharpened = merged.clone()
        for index in torch.nonzero(merged > 2 * self.lam).flatten().tolist():
            if index not in tops[0] or keys[index] == " ":
                continue
            for other in candidates:
                if other != index and keys[other].startswith(keys[index]):
                    sharpened[index] += merged[other]
        return sharpened / 2, True

    def choose(self, views: list[View]) -> Choice:
        scores, sharpened = self.table(views)
        best = int(torch.argmax(scores))
        key = self.union.keys[best]
        if key in self.eos_names:
            ids = [self.drafter.eos_id]
        else:
            ids = self.union.encode(0, key, self.prefix)
        return Choice(key.encode("utf-8"), float(scores[best]), sharpened, ids)

    def candidates(self, views: list[View]) -> list[list[Any]]:
        """Their scores over their union (sharpened where it decided), best first."""
        scores, _ = self.table(views)
        return top_candidates([k.encode("utf-8") for k in self.union.keys], scores)

    def written_ids(self, encoded: list[int]) -> list[int]:
        """Never asked (:meth:`choose` names the drafter's ids); the whole encoding, as theirs."""
        return encoded
