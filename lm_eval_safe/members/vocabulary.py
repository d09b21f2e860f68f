"""Token strings as bytes, the common currency of tokenizers that share nothing else.

Byte-level BPE pieces (``Ġ``, ``Ċ``, the GPT-2 byte map), SentencePiece pieces (``▁``) and
byte-fallback pieces (``<0xNN>``) all become the raw UTF-8 bytes they stand for, so two
tokenizers can be compared position by position (alignment) and token by token (union
vocabulary). Bytes rather than ``str``: a byte token may be half of a multi-byte character.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

EOS_KEY = b"\x00<eos>"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` map (printable stand-ins for all 256 bytes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def _decoder_types(tokenizer: Any) -> set[str]:
    if not tokenizer.is_fast:  # a Python tokenizer has no Rust pipeline to read
        return set()
    backend = tokenizer.backend_tokenizer
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "type" in node:
                found.add(str(node["type"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    # only these two components: serialising the whole tokenizer (a 262k vocabulary and its
    # merges) and parsing it back took seconds per process
    for component in (backend.decoder, backend.pre_tokenizer):
        if component is not None:
            walk(json.loads(component.__getstate__()))
    return found


@dataclass
class TokenVocabulary:
    """Per-tokenizer tables: the text bytes of each id, a key for union vocabularies, lookups."""

    text_bytes: list[bytes]
    keys: list[bytes]
    special_ids: frozenset[int]
    eos_ids: frozenset[int]
    adds_prefix_space: bool
    lookup: dict[bytes, int] = field(repr=False)
    fingerprint: str = ""

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, extra_eos: frozenset[int] = frozenset()
    ) -> TokenVocabulary:
        size = len(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
        byte_level = "ByteLevel" in _decoder_types(tokenizer)
        byte_map = _byte_decoder()
        added = {int(i): tok for i, tok in tokenizer.added_tokens_decoder.items()}
        special = {int(i) for i in tokenizer.all_special_ids}
        special |= {i for i, tok in added.items() if tok.special}
        eos = {i for i in (tokenizer.eos_token_id,) if i is not None} | set(extra_eos)
        text_bytes: list[bytes] = []
        keys: list[bytes] = []
        byte_ids: set[int] = set()
        for token_id, piece in enumerate(pieces):
            piece = piece if piece is not None else ""
            if token_id in eos:
                text, key = b"", EOS_KEY
            elif token_id in special:
                text, key = b"", b"\x00" + piece.encode("utf-8")
            elif token_id in added:
                text = added[token_id].content.encode("utf-8")
                key = text
            elif match := _BYTE_PIECE.match(piece):
                text = key = bytes([int(match.group(1), 16)])
                byte_ids.add(token_id)
            elif byte_level and all(ch in byte_map for ch in piece):
                text = key = bytes(byte_map[ch] for ch in piece)
            else:
                text = key = piece.replace("\u2581", " ").encode("utf-8")
            text_bytes.append(text)
            keys.append(key)

        def rank(i: int) -> int:  # a piece the model predicts, then byte fallback, then special
            return 2 if i in special else 1 if i in byte_ids else 0

        lookup: dict[bytes, int] = {}
        for token_id, key in enumerate(keys):
            current = lookup.get(key)
            if key and (current is None or rank(token_id) < rank(current)):
                lookup[key] = token_id
        probe = tokenizer.encode("a", add_special_tokens=False)
        adds_prefix_space = bool(probe) and text_bytes[probe[0]].startswith(b" ")
        digest = hashlib.sha1(b"\x01".join(keys)).hexdigest()[:16]
        return cls(
            text_bytes, keys, frozenset(special), frozenset(eos), adds_prefix_space, lookup, digest
        )

    @cached_property
    def ids_of(self) -> dict[bytes, tuple[int, ...]]:
        """Every id of each string (GaC's union map sums a member's ids spelling one string)."""
        ids: dict[bytes, list[int]] = {}
        for token_id, key in enumerate(self.keys):
            ids.setdefault(key, []).append(token_id)
        return {key: tuple(found) for key, found in ids.items()}

    @cached_property
    def most_ids_per_key(self) -> int:
        return max((len(v) for v in self.ids_of.values()), default=1)

    def spell(self, ids: list[int]) -> bytes:
        return b"".join(self.text_bytes[i] for i in ids)

    def token_ends(self, ids: list[int], text: bytes) -> list[int] | None:
        """Byte offset in ``text`` where each token ends, or None if the ids do not spell ``text``.

        A tokenizer that adds a dummy prefix space (SentencePiece ``add_dummy_prefix``) spells
        one leading space the text does not have; that phantom space is not counted.
        """
        spelled = self.spell(ids)
        shift = 0
        if spelled != text:
            if self.adds_prefix_space and spelled == b" " + text:
                shift = 1
            else:
                return None
        ends: list[int] = []
        total = 0
        for i in ids:
            total += len(self.text_bytes[i])
            ends.append(max(total - shift, 0))
        return ends

    def encode_text(self, tokenizer: Any, text: str) -> list[int]:
        """Ids for ``text`` continuing earlier text: no BOS, no dummy space that is not in the text."""
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if self.adds_prefix_space:
            if text.startswith(" "):
                alt = list(tokenizer.encode(text[1:], add_special_tokens=False))
                if self.spell(alt) == text.encode("utf-8"):
                    return alt
            elif ids and self.text_bytes[ids[0]] == b" ":
                ids = ids[1:]
        return ids


def is_char_boundary(text: bytes, offset: int) -> bool:
    """True unless ``offset`` falls inside a multi-byte UTF-8 character."""
    return offset >= len(text) or (text[offset] & 0xC0) != 0x80


def valid_utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that decodes; a draft may end inside a multi-byte character."""
    for cut in range(0, 4):
        try:
            return data[: len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="ignore")


def boundary_index(ends: list[int], offset: int) -> int | None:
    """Index of the token that starts at byte ``offset`` (one past the tokens ending there),
    or None when ``offset`` falls inside a token: the position is not a boundary."""
    i = bisect.bisect_right(ends, offset)
    return i if offset == 0 or (i > 0 and ends[i - 1] == offset) else None


def key_text(key: bytes) -> str:
    """A token string as a reader sees it: text, or the special token's name."""
    if key == EOS_KEY:
        return "<eos>"
    if key.startswith(b"\x00"):
        return key[1:].decode("utf-8", errors="replace")
    return key.decode("utf-8", errors="replace")
