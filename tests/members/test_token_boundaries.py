"""Token end offsets and boundaries shared by tokenizers.

Why these tests: SAFE ensembles only where the drafted text ends on a token boundary of
*every* tokenizer (docs/algorithm.md, Token strings and alignment). That rests on ``TokenVocabulary`` turning each id into the
exact bytes it stands for: a wrong byte (a ``Ġ``/``▁`` left in, a dummy prefix space counted, a
byte token misread) silently shifts every boundary after it, and the ensemble still "runs". So
every check here compares against a reference computed independently: the tokenizer's own
``decode`` of each prefix of ids, Python's own UTF-8 handling, or a brute-force search over
prefixes -- never against values produced by the code under test.
"""

from __future__ import annotations

from typing import Any

import pytest
from vocab_cases import (
    ALL_NAMES,
    HARD_TEXTS,
    PAIRS,
    STRIPS_ONE_LEADING_SPACE,
    TINY,
    _get,
)

from lm_eval_safe.members.vocabulary import is_char_boundary, valid_utf8_prefix

# --------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------


def _decode(tok: Any, ids: list[int]) -> str:
    """The tokenizer's own rendering of ids: nothing skipped, no clean-up of spaces."""
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _dropped_by_decoder(name: str, tok: Any, ids: list[int], text: str) -> int:
    """How many leading bytes of ``text`` the decoder does not render (0, or 1 for Strip).

    Also asserts the full decode reproduces ``text``: exactly where the decoder is lossless,
    and up to the one leading space a Strip decoder is documented to drop.
    """
    full = _decode(tok, ids)
    if full == text:
        return 0
    assert name in STRIPS_ONE_LEADING_SPACE, f"{name} decodes {text!r} as {full!r}"
    assert text.startswith(" ") and full == text[1:], (text, full)
    return 1


def _reference_prefixes(name: str, tok: Any, ids: list[int], text: str) -> list[bytes | None]:
    """The bytes each prefix ``ids[:k]`` (k = 1..n) stands for, per ``tok.decode``.

    None where the prefix ends inside a multi-byte character (the decoder then renders
    U+FFFD, so its length says nothing about the byte offset).
    """
    dropped = b" " * _dropped_by_decoder(name, tok, ids, text)
    out: list[bytes | None] = []
    for k in range(1, len(ids) + 1):
        rendered = _decode(tok, ids[:k])
        out.append(None if "\ufffd" in rendered else dropped + rendered.encode("utf-8"))
    return out


def _char_starts(text: str) -> set[int]:
    """Byte offsets (1..len) at which a character ends, from Python's own UTF-8 encoder."""
    offsets, total = set(), 0
    for ch in text:
        total += len(ch.encode("utf-8"))
        offsets.add(total)
    return offsets


# --------------------------------------------------------------------------------------
# Spelling and token ends
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_NAMES)
def test_spell_and_token_ends_match_decode(request: pytest.FixtureRequest, name: str) -> None:
    """``spell`` gives the text's bytes and ``token_ends`` the offsets decode of prefixes gives.

    Why: verifier alignment (docs/algorithm.md, Token strings and alignment) compares byte offsets, so each end must be where
    the tokenizer itself says the prefix of tokens ends. The one tolerated difference is a
    SentencePiece dummy prefix space that is merged into the first piece (``▁The``): it is
    spelled but not part of the text, and ``token_ends`` must not count it.
    """
    tok, vocab = _get(request, name)
    for text in HARD_TEXTS:
        text_bytes = text.encode("utf-8")
        ids = vocab.encode_text(tok, text)
        assert ids, text
        assert not any(i in vocab.special_ids for i in ids), (name, text, ids)
        spelled = vocab.spell(ids)
        phantom = vocab.adds_prefix_space and not text.startswith(" ")
        assert spelled == text_bytes or (phantom and spelled == b" " + text_bytes), (
            name,
            text,
            spelled,
        )

        ends = vocab.token_ends(ids, text_bytes)
        assert ends is not None, (name, text)
        assert len(ends) == len(ids)
        assert ends[-1] == len(text_bytes)
        assert ends == sorted(ends)

        reference = _reference_prefixes(name, tok, ids, text)
        checked = 0
        for k, (end, expected) in enumerate(zip(ends, reference, strict=True), start=1):
            clean = expected is not None
            # The decoder renders U+FFFD exactly when the prefix stops inside a character.
            assert clean == is_char_boundary(text_bytes, end), (name, text, k, end)
            if clean:
                assert len(expected) == end, (name, text, k, expected, end)
                assert text_bytes[:end] == expected, (name, text, k)
                checked += 1
        assert checked >= 1


@pytest.mark.parametrize("name", ALL_NAMES)
def test_token_ends_agree_with_offset_mapping(request: pytest.FixtureRequest, name: str) -> None:
    """Where ``encode_text`` is the plain encoding, ends equal the tokenizer's char offsets.

    Why: a second, decode-free reference. Fast tokenizers report each token's character span;
    converted to bytes, the span's end is the token's end offset -- for tokens that are whole
    characters (a byte token of a split character gets its whole character's span, so those
    are left out).
    """
    tok, vocab = _get(request, name)
    compared = 0
    for text in HARD_TEXTS:
        ids = vocab.encode_text(tok, text)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) != ids or vocab.adds_prefix_space:
            continue  # encode_text stripped a dummy-space token: offsets refer to other ids
        text_bytes = text.encode("utf-8")
        ends = vocab.token_ends(ids, text_bytes)
        assert ends is not None
        for end, (_, char_end) in zip(ends, enc["offset_mapping"], strict=True):
            if not is_char_boundary(text_bytes, end):
                continue
            assert end == len(text[:char_end].encode("utf-8")), (name, text)
            compared += 1
    if name != "tiny_sp":  # its dummy prefix space makes every text take the other branch
        assert compared > 0


def test_token_ends_rejects_ids_that_do_not_spell_the_text(
    request: pytest.FixtureRequest,
) -> None:
    """A tokenization of other text must give None, never offsets into the wrong text.

    Why: ``VerifierRun.sync`` treats None as "nothing here is aligned"; wrong offsets would
    let SAFE ensemble on a verifier conditioned on text the drafter did not write.
    """
    for name in TINY:
        tok, vocab = _get(request, name)
        ids = vocab.encode_text(tok, "hello world")
        assert vocab.token_ends(ids, b"hello world!") is None
        assert vocab.token_ends(ids, b"hello worl") is None
        assert vocab.token_ends(ids, b"  hello world") is None


# --------------------------------------------------------------------------------------
# Common boundaries of two tokenizers
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_common_boundaries_match_brute_force(
    request: pytest.FixtureRequest, first: str, second: str
) -> None:
    """Intersecting ``token_ends`` finds exactly the offsets where both tokenizations break.

    Why: these are SAFE's candidate ensemble points. The reference tries every byte offset
    ``k`` of the text and asks, for each tokenizer, whether some prefix of its ids decodes to
    exactly ``text[:k]`` (character boundaries only: mid-character offsets never align).
    """
    a_tok, a_vocab = _get(request, first)
    b_tok, b_vocab = _get(request, second)
    nontrivial = 0
    for text in HARD_TEXTS:
        text_bytes = text.encode("utf-8")
        chars = _char_starts(text)
        found = None
        brute = set(chars)
        for name, tok, vocab in ((first, a_tok, a_vocab), (second, b_tok, b_vocab)):
            ids = vocab.encode_text(tok, text)
            ends = vocab.token_ends(ids, text_bytes)
            assert ends is not None
            mine = {e for e in ends if e > 0 and is_char_boundary(text_bytes, e)}
            found = mine if found is None else found & mine
            prefixes = {p for p in _reference_prefixes(name, tok, ids, text) if p is not None}
            brute = {k for k in brute if text_bytes[:k] in prefixes}
        assert found == brute, (first, second, text, sorted(found), sorted(brute))
        assert len(text_bytes) in found
        nontrivial += len(found) < len(chars)
    assert nontrivial > 0  # the texts must contain offsets where the tokenizers disagree


# --------------------------------------------------------------------------------------
# Character boundaries and valid UTF-8 prefixes
# --------------------------------------------------------------------------------------


def test_is_char_boundary_on_hand_made_bytes() -> None:
    """Offsets inside a multi-byte character are not boundaries; the end of the text is.

    Why: a drafted token may end half-way through a character (byte tokens); such a position
    must never be treated as aligned.
    """
    cafe = "café".encode()  # b"caf\xc3\xa9"
    assert [is_char_boundary(cafe, k) for k in range(6)] == [True, True, True, True, False, True]
    thumb = "👍".encode()  # four bytes
    assert [is_char_boundary(thumb, k) for k in range(5)] == [True, False, False, False, True]
    assert is_char_boundary(b"", 0)
    assert is_char_boundary(b"abc", 7)
    for text in HARD_TEXTS:
        data = text.encode("utf-8")
        expected = _char_starts(text) | {0}
        assert {k for k in range(len(data) + 1) if is_char_boundary(data, k)} == expected, text


def test_valid_utf8_prefix_on_hand_made_bytes() -> None:
    """The longest decodable prefix: a draft may stop inside a character, never lose text.

    Why: the decoder re-tokenizes ``valid_utf8_prefix(drafted bytes)`` for the verifiers; one
    character too many raises, one too few misaligns every offset after it.
    """
    assert valid_utf8_prefix(b"") == ""
    assert valid_utf8_prefix(b"abc") == "abc"
    assert valid_utf8_prefix("café".encode()[:-1]) == "caf"
    assert valid_utf8_prefix(b"x" + "数".encode()[:2]) == "x"
    assert valid_utf8_prefix(b"ok " + "👍".encode()[:3]) == "ok "
    assert valid_utf8_prefix(b"ok " + "👍".encode()[:1]) == "ok "
    assert valid_utf8_prefix("👍🏽".encode()) == "👍🏽"
    assert valid_utf8_prefix(b"ab\xff") == "ab"
    for text in HARD_TEXTS:
        data = text.encode("utf-8")
        for k in range(len(data) + 1):
            expected, total = "", 0
            for ch in text:
                total += len(ch.encode("utf-8"))
                if total > k:
                    break
                expected += ch
            assert valid_utf8_prefix(data[:k]) == expected, (text, k)
