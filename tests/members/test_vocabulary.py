"""Token strings as bytes and the union vocabulary.

Why these tests: GaC averages distributions over a union of normalised token strings
(docs/algorithm.md, Aggregators), and UniTE looks strings up across vocabularies. A wrong byte splits one string
into two union entries, and the ensemble still "runs". Every check compares against a
reference computed independently: the tokenizer's own ``decode`` of single tokens and its own
encodings -- never against values produced by the code under test.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from vocab_cases import (
    ALL_NAMES,
    REAL,
    STRIPS_ONE_LEADING_SPACE,
    TINY,
    _get,
)

from lm_eval_safe.ensemble.aggregate import UnionVocabulary
from lm_eval_safe.members.vocabulary import EOS_KEY, TokenVocabulary

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
