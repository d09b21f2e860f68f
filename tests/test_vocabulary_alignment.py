"""Token strings as bytes, token end offsets, cross-tokenizer boundaries and the union vocabulary.

Why these tests: SAFE ensembles only where the drafted text ends on a token boundary of
*every* tokenizer (SAFE_SPEC §3), and GaC averages distributions over a union of normalised
token strings (§4). Both rest on ``TokenVocabulary`` turning each id into the exact bytes it
stands for. A wrong byte (a ``Ġ``/``▁`` left in, a dummy prefix space counted, a byte token
misread) silently shifts every boundary after it or splits one string into two union
entries, and the ensemble still "runs". So every check here compares against a reference
computed independently: the tokenizer's own ``decode`` of each prefix of ids, Python's own
UTF-8 handling, or a brute-force search over prefixes -- never against values produced by
the code under test.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from lm_eval_safe.aggregate import UnionVocabulary
from lm_eval_safe.aliases import ALIASES
from lm_eval_safe.disk_cache import cache_root
from lm_eval_safe.vocabulary import EOS_KEY, TokenVocabulary, is_char_boundary, valid_utf8_prefix

HARD_TEXTS = [
    r"\frac{a}{b}",
    r"\boxed{42}",
    "123456789",
    "a    b   c",
    "x\n\ny",
    "\n\nafter newlines",
    "café naïve",
    "数学问题",
    "👍🏽 ok",
    " leading",
    "  two leading spaces",
    "trailing spaces   ",
    r"The answer is $\frac{1}{2}$, so \boxed{42}." + "\n\n",
    "emoji 🙂🚀 in 数学 text: naïve \\frac{3}{4}",
]

TINY = ("tiny_bpe", "tiny_sp")
REAL = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
# The tiny SentencePiece-style decoder ends with Strip(" ", 1, 0) (as Llama-2's does): decoding
# drops one leading space, real or dummy. Every other decoder here is lossless.
STRIPS_ONE_LEADING_SPACE = {"tiny_sp"}

ALL_NAMES = [*TINY, *(pytest.param(name, marks=pytest.mark.real) for name in REAL)]
PAIRS = [
    ("tiny_bpe", "tiny_sp"),
    pytest.param("smollm2-135m", "gemma3-270m", marks=pytest.mark.real),
    pytest.param("smollm2-135m", "qwen2.5-coder-0.5b", marks=pytest.mark.real),
    pytest.param("gemma3-270m", "qwen2.5-coder-0.5b", marks=pytest.mark.real),
]

Loaded = dict[str, tuple[Any, TokenVocabulary]]


# --------------------------------------------------------------------------------------
# Fixtures: each tokenizer and its vocabulary are built once per module
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_loaded(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> Loaded:
    """The two tiny tokenizers, loaded by path like the backend loads them."""
    out: Loaded = {}
    for name, folder in (("tiny_bpe", tiny_bpe_dir), ("tiny_sp", tiny_sp_dir)):
        tok = AutoTokenizer.from_pretrained(folder)
        out[name] = (tok, TokenVocabulary.for_tokenizer(tok))
    return out


def _real_tokenizer(alias: str, models_dir: Path) -> Any:
    """The alias's tokenizer, without loading weights.

    Why not ``load_member``: it would de-quantize (and cache) a whole model just for its
    tokenizer. The converted folder ``load_member`` leaves in the cache holds the very
    tokenizer that the backend uses and loads in a second or two; when it is absent (Qwen is
    often not converted yet) the GGUF file is read directly, which gives the same tokenizer.
    """
    gguf = ALIASES[alias].file
    stem = Path(gguf).stem
    for folder in sorted((cache_root() / "converted").glob(f"{stem}-*")):
        if (folder / "complete.json").is_file() and (folder / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(models_dir, gguf_file=gguf)


@pytest.fixture(scope="module")
def real_loaded(real_models_dir: Path) -> Loaded:
    """The three real tokenizers (SmolLM2 byte BPE, Gemma 3 SentencePiece, Qwen byte BPE)."""
    out: Loaded = {}
    for alias in REAL:
        start = time.perf_counter()
        tok = _real_tokenizer(alias, real_models_dir)
        out[alias] = (tok, TokenVocabulary.for_tokenizer(tok))
        print(f"{alias}: tokenizer + vocabulary in {time.perf_counter() - start:.1f}s")
    return out


def _get(request: pytest.FixtureRequest, name: str) -> tuple[Any, TokenVocabulary]:
    """Look a tokenizer up by name, instantiating only the fixture that holds it."""
    fixture = "tiny_loaded" if name in TINY else "real_loaded"
    return request.getfixturevalue(fixture)[name]


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

    Why: verifier alignment (SAFE_SPEC §3) compares byte offsets, so each end must be where
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


# --------------------------------------------------------------------------------------
# Keys, EOS, union vocabulary
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_NAMES)
def test_keys_equal_single_token_decode(request: pytest.FixtureRequest, name: str) -> None:
    """Every ordinary token's key is the text its tokenizer decodes it to.

    Why: the union vocabulary (GaC) identifies tokens of different tokenizers by key, so a key
    must be the plain text -- no ``Ġ``, ``▁`` or ``<0xNN>`` spelling left. Tokens that are only
    part of a character decode to U+FFFD; for those the key must be the same partial bytes
    (decoding them with replacement gives the same text).
    """
    tok, vocab = _get(request, name)
    assert len(vocab) == len(tok)
    ordinary = [i for i in range(len(tok)) if i not in vocab.special_ids]
    decoded = tok.batch_decode(
        [[i] for i in ordinary], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    partial = 0
    for token_id, text in zip(ordinary, decoded, strict=True):
        key = vocab.keys[token_id]
        if "\ufffd" in text:
            partial += 1
            assert key.decode("utf-8", errors="replace") == text, (token_id, key, text)
        elif name in STRIPS_ONE_LEADING_SPACE and text != key.decode("utf-8", "replace"):
            assert key == b" " + text.encode("utf-8"), (token_id, key, text)
        else:
            assert key == text.encode("utf-8"), (token_id, key, text)
    assert partial < len(ordinary) // 2


@pytest.mark.parametrize("name", ALL_NAMES)
def test_lookup_prefers_the_piece_the_tokenizer_uses(
    request: pytest.FixtureRequest, name: str
) -> None:
    """``lookup[key]`` is the id the tokenizer itself produces for that one-token string.

    Why: UniTE reads a member's probability of a string through ``lookup``, and the decoder
    turns a chosen string into drafter ids through it. SentencePiece vocabularies hold the
    same byte twice (the byte-fallback ``<0x31>`` and the piece ``1``); the model predicts the
    piece, so answering with the byte token gives a string almost zero probability.
    """
    tok, vocab = _get(request, name)
    for text in ["1", "7", "A", ".", "(", "}", "\n", "x", "="]:
        ids = vocab.encode_text(tok, text)
        if len(ids) == 1 and vocab.spell(ids) == text.encode("utf-8"):
            assert vocab.lookup[text.encode("utf-8")] == ids[0], (name, text)
    unk = tok.unk_token_id
    both = 0
    for code in range(0x21, 0x7F):
        piece_id = tok.convert_tokens_to_ids(chr(code))
        byte_id = tok.convert_tokens_to_ids(f"<0x{code:02X}>")
        if piece_id in (None, unk) or byte_id in (None, unk) or piece_id == byte_id:
            continue
        assert vocab.lookup[bytes([code])] == piece_id, (name, chr(code), byte_id)
        both += 1
    if name in ("tiny_sp", "gemma3-270m"):  # byte fallback: the duplicates do occur
        assert both > 0


@pytest.mark.parametrize("name", ALL_NAMES)
def test_eos_maps_to_the_shared_eos_key(request: pytest.FixtureRequest, name: str) -> None:
    """Every tokenizer's EOS gets ``EOS_KEY`` (and no text), and nothing else does.

    Why: "stop" must be one union entry whatever each model calls it (``<|im_end|>``,
    ``<eos>``, ``</s>``), or the members' EOS mass is split and never wins.
    """
    tok, vocab = _get(request, name)
    eos = tok.eos_token_id
    assert eos is not None
    assert vocab.keys[eos] == EOS_KEY
    assert vocab.text_bytes[eos] == b""
    assert [i for i, key in enumerate(vocab.keys) if key == EOS_KEY] == [eos]
    if len(tok) > 100_000:
        return  # rebuilding a 150k-260k vocabulary only to test extra_eos costs seconds
    other = next(i for i in vocab.special_ids if i != eos)
    extended = TokenVocabulary.for_tokenizer(tok, extra_eos=frozenset({other}))
    assert extended.keys[other] == EOS_KEY and extended.keys[eos] == EOS_KEY


@pytest.mark.real
def test_union_vocabulary_of_the_real_tokenizers(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Each token of each member maps to the one union entry holding its key.

    Why: GaC averages by scattering each member's probabilities into the union through
    these maps; a token mapped to the wrong entry moves probability to another string, and
    duplicate entries split one string's probability. Also checks the on-disk cache: the
    decoder builds the union once per member set and must get identical maps back.
    """
    loaded = [_get(request, alias) for alias in REAL]
    vocabs = [vocab for _, vocab in loaded]
    start = time.perf_counter()
    union = UnionVocabulary.build(vocabs)
    print(f"union vocabulary of {REAL}: {len(union)} entries in {time.perf_counter() - start:.2f}s")

    assert len(set(union.keys)) == len(union.keys)
    all_keys = set()
    for vocab in vocabs:
        all_keys.update(vocab.keys)
    assert set(union.keys) == all_keys
    for vocab, mapping in zip(vocabs, union.maps, strict=True):
        assert mapping.dtype == torch.long and mapping.shape == (len(vocab),)
        assert int(mapping.min()) >= 0 and int(mapping.max()) < len(union)
        assert [union.keys[i] for i in mapping.tolist()] == vocab.keys

    # The same normalised string in different tokenizers is one entry.
    for text in [" the", "The", "\n\n", "1", " answer", "数学"]:
        entries = set()
        for (tok, vocab), mapping in zip(loaded, union.maps, strict=True):
            ids = vocab.encode_text(tok, text)
            if len(ids) == 1:
                entries.add(int(mapping[ids[0]]))
        assert len(entries) == 1, (text, entries)
    smol, _, qwen = (tok for tok, _ in loaded)
    smol_the = smol.convert_tokens_to_ids("Ġthe")
    qwen_the = qwen.convert_tokens_to_ids("Ġthe")
    assert union.keys[int(union.maps[0][smol_the])] == b" the"
    assert int(union.maps[0][smol_the]) == int(union.maps[2][qwen_the])
    eos_entries = {int(m[tok.eos_token_id]) for (tok, _), m in zip(loaded, union.maps, strict=True)}
    assert len(eos_entries) == 1 and union.keys[eos_entries.pop()] == EOS_KEY

    # Cache: the first build writes it; the second reads it even if the vocabularies' keys
    # were gone (same fingerprints), which proves it did not rebuild.
    start = time.perf_counter()
    cached = UnionVocabulary.build(vocabs, cache_dir=tmp_path)
    written = time.perf_counter() - start
    assert list((tmp_path / "union-vocab").glob("*.pt"))
    hollow = [dataclasses.replace(v, keys=[]) for v in vocabs]
    start = time.perf_counter()
    reloaded = UnionVocabulary.build(hollow, cache_dir=tmp_path)
    print(
        f"union vocabulary: build+save {written:.2f}s, load from cache {time.perf_counter() - start:.2f}s"
    )
    for other in (cached, reloaded):
        assert other.keys == union.keys
        assert len(other.maps) == len(union.maps)
        for mine, theirs in zip(union.maps, other.maps, strict=True):
            assert torch.equal(mine, theirs)


def test_union_vocabulary_of_the_tiny_tokenizers(request: pytest.FixtureRequest) -> None:
    """The tiny pair (byte BPE vs SentencePiece) shares entries for the strings both have.

    Why: the same invariants as for the real tokenizers, on a pair that runs without real
    models: in particular SentencePiece ``▁word`` and byte-level ``Ġword`` must meet.
    """
    (bpe, bpe_vocab), (sp, sp_vocab) = (_get(request, name) for name in TINY)
    union = UnionVocabulary.build([bpe_vocab, sp_vocab])
    assert len(set(union.keys)) == len(union.keys)
    for vocab, mapping in zip((bpe_vocab, sp_vocab), union.maps, strict=True):
        assert [union.keys[i] for i in mapping.tolist()] == vocab.keys
    shared = 0
    for piece_bpe, piece_sp in [("Ġthe", "▁the"), ("Ġclips", "▁clips"), ("Ġ", "▁")]:
        bpe_id = bpe.convert_tokens_to_ids(piece_bpe)
        sp_id = sp.convert_tokens_to_ids(piece_sp)
        if bpe_id == bpe.unk_token_id or sp_id == sp.unk_token_id or None in (bpe_id, sp_id):
            continue
        assert int(union.maps[0][bpe_id]) == int(union.maps[1][sp_id]), piece_bpe
        shared += 1
    assert shared > 0
    assert int(union.maps[0][bpe.eos_token_id]) == int(union.maps[1][sp.eos_token_id])
