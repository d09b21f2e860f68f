"""GaC's union vocabulary as the SAFE authors' code builds it (``reference=authors``), and how
their code writes a chosen union string as a member's ids (:mod:`lm_eval_safe.ensemble.authors.aggregate`).

Their union is made of ``get_vocab()``'s raw strings, not of the bytes tokens stand for
(:class:`lm_eval_safe.ensemble.aggregate.UnionVocabulary`): a byte-level vocabulary's ``Ġ`` and ``Ċ``
become a space and a newline and nothing else of the GPT-2 byte map is undone, so ``’`` stays
``âĢĻ`` there and never meets a SentencePiece ``’``; ``▁`` becomes a space; each member's byte
tokens are the names ``<0x00>``-``<0xFF>`` (a byte-level vocabulary's tokens of the first 128
bytes included, except that digits and letters are mapped to the characters when the other
member is not byte-level). Their code refuses a byte-level tokenizer that gives two of those
bytes one id (SmolLM2's gives six control bytes its unknown id): so does this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lm_eval_safe.members.member import Member

_DIGITS_AND_LETTERS = [*range(0x30, 0x3A), *range(0x41, 0x5B), *range(0x61, 0x7B)]


def _byte_name(value: int) -> str:
    return f"<0x{value:02X}>"


def _byte_level(vocab: dict[str, int]) -> bool:
    """Their test: more tokens start with ``Ġ`` than with ``▁``."""
    return sum(t.startswith("Ġ") for t in vocab) > sum(t.startswith("▁") for t in vocab)


def byte_tokens(tokenizer: Any, name: str) -> dict[str, int]:
    """Their ``check_byte_mappings``: the byte names and each one's id."""
    vocab = tokenizer.get_vocab()
    if _byte_level(vocab):
        found = {}
        for b in range(128):
            ids = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(chr(b)))
            if not ids:
                raise ValueError(
                    f"member {name!r}'s tokenizer gives no token for byte {_byte_name(b)}, where the "
                    "authors' union needs one token per byte"
                )
            found[_byte_name(b)] = ids[0]
        return found
    found = {}
    for b in range(256):
        name = _byte_name(b)
        if name not in vocab:
            if name == "<0x09>":
                continue
            raise ValueError(f"the authors' union needs the token {name}, which the vocabulary lacks")
        found[name] = vocab[name]
    return found


def _raw_strings(tokenizer: Any, bytes_of: dict[str, int], name: str) -> dict[int, str]:
    """Each id's union string, the byte tokens left out (their ``get_vocab_union_and_mapping``)."""
    vocab = dict(tokenizer.get_vocab())
    by_id: dict[int, list[str]] = {}
    for token, token_id in vocab.items():
        by_id.setdefault(token_id, []).append(token)
    for token_id in bytes_of.values():
        tokens = [t for t in by_id.get(token_id, []) if t in vocab]
        if len(tokens) != 1:
            raise ValueError(
                f"member {name!r}'s tokenizer gives {len(tokens)} tokens for id {token_id}, where the "
                "authors' union needs one token per byte"
            )
        del vocab[tokens[0]]
    if _byte_level(vocab):
        return {i: t.replace("Ġ", " ").replace("Ċ", "\n") for t, i in vocab.items()}
    return {i: t.replace("▁", " ") if t.startswith("▁") else t for t, i in vocab.items()}


def special_prefix(tokenizer: Any) -> str:
    """Their ``find_special_underscore_token``: a word the tokenizer keeps apart, written before a
    string so that encoding the string alone adds no space marker: ``"¢"`` for a 256,000-id
    vocabulary (their Gemma rule), none (``""``) for a byte-level one. Otherwise the shortest ``▁``
    token (then the first in order) that holds one ``▁``, is not blank once it is removed and is
    part of no other ``▁`` token, without its ``▁``. A token occurs in the joined list of all
    ``▁`` tokens once as itself, so it is part of another exactly when it occurs twice (their code
    compares every pair: hours on a 262k vocabulary)."""
    if tokenizer.vocab_size == 256000:
        return "¢"
    vocab = tokenizer.get_vocab()
    if _byte_level(vocab):
        return ""
    marked = [t for t in vocab if t.startswith("▁") and t != "▁"]
    joined = "\x00".join(marked)
    for token in sorted((t for t in marked if t.count("▁") == 1 and t[1:].strip()), key=lambda t: (len(t), t)):
        if joined.count(token) == 1:
            return token[1:]
    raise ValueError("no special underscore token in the vocabulary")


@dataclass
class AuthorsUnion:
    """Their union: its strings, and per member the union index of each id (-1: none)."""

    keys: list[str]
    maps: list[torch.Tensor]
    byte_ids: list[dict[str, int]]
    tokenizers: list[Any]

    @classmethod
    def build(cls, members: list[Member]) -> AuthorsUnion:
        bytes_of = [byte_tokens(m.tokenizer, m.name) for m in members]
        strings = [_raw_strings(m.tokenizer, b, m.name) for m, b in zip(members, bytes_of, strict=True)]
        index: dict[str, int] = {_byte_name(b): b for b in range(256)}
        for table in strings:
            for text in table.values():
                index.setdefault(text, len(index))
        all_byte_level = all(len(b) == 128 for b in bytes_of)
        maps = []
        for member, table, byte_map in zip(members, strings, bytes_of, strict=True):
            mapping = torch.full((len(member.vocab),), -1, dtype=torch.long)
            for token_id, text in table.items():
                if token_id < len(mapping):
                    mapping[token_id] = index[text]
            for name, token_id in byte_map.items():
                value = int(name[3:5], 16)
                forced = not all_byte_level and len(byte_map) == 128 and value in _DIGITS_AND_LETTERS
                if forced and chr(value) not in index:
                    raise ValueError(
                        f"the authors' union writes byte {name} of member {member.name!r} as "
                        f"{chr(value)!r}, which no vocabulary holds as a token"
                    )
                mapping[token_id] = index[chr(value)] if forced else index[name]
            maps.append(mapping)
        return cls(list(index), maps, bytes_of, [m.tokenizer for m in members])

    def project(self, member: int, logprobs: torch.Tensor) -> torch.Tensor:
        """A member's probabilities summed per union string (float32, as their sparse product)."""
        mapping = self.maps[member]
        probs = logprobs.float().exp()
        kept = mapping >= 0
        out = torch.zeros(len(self.keys), dtype=torch.float32)
        out.scatter_add_(0, mapping[kept], probs[kept])
        return out

    def encode(self, member: int, key: str, prefix: str) -> list[int]:
        """Their ``get_token_ids``: a byte name's id, else the ids ``key`` adds after ``prefix``
        (then after ``;``), else ``key`` encoded alone."""
        if key in self.byte_ids[member]:
            return [self.byte_ids[member][key]]
        tokenizer = self.tokenizers[member]
        for before in (prefix, ";"):
            alone = tokenizer.encode(before, add_special_tokens=False)
            joined = tokenizer.encode(before + key, add_special_tokens=False)
            if joined[: len(alone)] == alone and joined[len(alone) :]:
                return list(joined[len(alone) :])
        return list(tokenizer.encode(key, add_special_tokens=False))
