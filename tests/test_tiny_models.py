"""Tests for the tiny test models themselves.

Why test test-helpers: every backend test trusts these fixtures to behave like the real
model families (exact round-trips, BOS conventions, padded vocabularies, non-degenerate
outputs). If a transformers/tokenizers upgrade silently changed that, backend tests would
keep passing while testing nothing; these tests make such a change fail loudly here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_models import (
    BPE_CHAT_TEMPLATE,
    DEFAULT_CORPUS,
    SP_CHAT_TEMPLATE,
    build_default_corpus,
    make_tiny_causal_lm,
    perturbed_copy,
    train_byte_bpe_tokenizer,
    train_sentencepiece_style_tokenizer,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

HARD_TEXTS = [
    r"$\frac{1}{2} + \frac{1}{3} = \frac{5}{6}$ so the answer is \boxed{42}.",
    "Natalia sold 48 clips in April and 24 in May: 48 + 24 = 72. #### 72",
    "31415926535 8979 0.000123 -7e10",
    "runs    of     spaces   and\ttabs\t\t",
    "line one\nline two\n\n\nline five\r\nwindows",
    " leading space",
    "  two leading spaces and trailing  ",
    "café naïve résumé Zürich Ångström crème brûlée",
    "你好，世界。数学问题 龍 鬱",  # 龍/鬱 are not in the corpus: byte fallback for SP
    "emoji 🙂🚀 🦄 👍🏽 ❤️ 🏳️‍🌈",
    "def f(x):\n    return x ** 2  # square\n",
    "<tag> {braces} [brackets] `code` \\ backslash ~ ^ |",
    "",
    " ",
    "\n",
]

FAMILIES = ["tiny_bpe_dir", "tiny_sp_dir"]


def _load_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """Load a fixture tokenizer exactly like the backend would (by path, offline)."""
    return AutoTokenizer.from_pretrained(folder)


def _load_model(folder: Path) -> LlamaForCausalLM:
    """Load a fixture model by path; float32 to compare logits bit-for-bit with the original."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_offline_environment_is_set() -> None:
    """conftest must force offline mode before transformers is imported."""
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


def test_default_corpus_is_varied_and_deterministic() -> None:
    """The corpus must contain the hard categories, and regenerate identically."""
    text = "\n".join(DEFAULT_CORPUS)
    assert len(DEFAULT_CORPUS) >= 200
    for needle in (r"\frac{", r"\boxed{", "####", "def ", "\n", "    ", "é", "你", "🚀"):
        assert needle in text, needle
    assert build_default_corpus() == DEFAULT_CORPUS


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", HARD_TEXTS, ids=range(len(HARD_TEXTS)))
def test_round_trip_exact(family: str, text: str, request: pytest.FixtureRequest) -> None:
    """decode(encode(t)) == t for every hard text, with and without special tokens."""
    tok = _load_tokenizer(request.getfixturevalue(family))
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    plain = tok.encode(text, add_special_tokens=False)
    assert tok.decode(plain) == text
    assert all(i < len(tok) for i in ids)


def test_sp_adds_bos_bpe_does_not(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """Llama/Gemma convention (BOS added on encode) vs GPT-2/SmolLM2/Qwen (nothing added)."""
    bpe, sp = _load_tokenizer(tiny_bpe_dir), _load_tokenizer(tiny_sp_dir)
    text = "The answer is 42."

    sp_ids = sp.encode(text)
    assert sp.bos_token == "<s>"
    assert sp_ids[0] == sp.bos_token_id
    assert sp_ids[1:] == sp.encode(text, add_special_tokens=False)
    assert sp.eos_token_id not in sp_ids

    bpe_ids = bpe.encode(text)
    assert bpe.eos_token == bpe.bos_token == "<|endoftext|>"
    assert bpe_ids == bpe.encode(text, add_special_tokens=False)
    assert bpe.bos_token_id not in bpe_ids


def test_special_tokens_and_padding(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """Pad tokens exist (BPE reuses eos like Qwen; SP has a distinct <pad>) and padding works."""
    bpe, sp = _load_tokenizer(tiny_bpe_dir), _load_tokenizer(tiny_sp_dir)
    assert bpe.pad_token_id == bpe.eos_token_id
    assert sp.pad_token == "<pad>"
    assert len({sp.pad_token_id, sp.eos_token_id, sp.bos_token_id, sp.unk_token_id}) == 4
    assert sp.padding_side == "left"
    assert bpe.padding_side == "right"
    batch = sp(["a", "a longer line of text"], padding=True)
    assert batch["input_ids"][0][0] == sp.pad_token_id
    assert batch["attention_mask"][0][0] == 0


def test_vocabularies_differ(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """The two families must tokenize differently, or cross-tokenizer tests prove nothing."""
    bpe, sp = _load_tokenizer(tiny_bpe_dir), _load_tokenizer(tiny_sp_dir)
    assert bpe.get_vocab() != sp.get_vocab()
    assert len(bpe) != len(sp)
    text = "Natalia had 12 apples."
    assert bpe.convert_ids_to_tokens(bpe.encode(text)) != sp.convert_ids_to_tokens(
        sp.encode(text, add_special_tokens=False)
    )
    # Family markers: Ġ-prefixed byte-level pieces vs ▁-prefixed pieces plus <0xNN> bytes.
    assert any(t.startswith("Ġ") for t in bpe.get_vocab())
    assert any(t.startswith("▁") for t in sp.get_vocab())
    assert all(f"<0x{b:02X}>" in sp.get_vocab() for b in range(256))


def test_sp_unseen_characters_use_byte_fallback(tiny_sp_dir: Path) -> None:
    """A character absent from the corpus becomes UTF-8 byte tokens, and still decodes."""
    sp = _load_tokenizer(tiny_sp_dir)
    pieces = sp.convert_ids_to_tokens(sp.encode("龍", add_special_tokens=False))
    assert pieces[-3:] == ["<0xE9>", "<0xBE>", "<0x8D>"]
    assert sp.unk_token_id not in sp.encode("龍 🦄")


def test_leading_space_is_part_of_the_next_token(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """Continuations like " 72" carry their space in the first token in both families.

    This is the property that makes context/continuation splitting subtle.
    """
    bpe, sp = _load_tokenizer(tiny_bpe_dir), _load_tokenizer(tiny_sp_dir)
    assert bpe.convert_ids_to_tokens(bpe.encode("x the"))[-1] == "Ġthe"
    assert sp.convert_ids_to_tokens(sp.encode("x the", add_special_tokens=False))[-1] == "▁the"


def test_tokenizer_training_is_deterministic() -> None:
    """Same corpus and size -> identical vocabularies, so fixtures are reproducible."""
    for train in (train_byte_bpe_tokenizer, train_sentencepiece_style_tokenizer):
        first, second = train(), train()
        assert first.get_vocab() == second.get_vocab()
        # Whole pipeline (merges, normalizer, decoder, post-processor) must match too.
        assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_chat_templates_differ_and_render(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """Each family ships its own chat template (ChatML vs Gemma-style) that survives saving."""
    bpe, sp = _load_tokenizer(tiny_bpe_dir), _load_tokenizer(tiny_sp_dir)
    assert bpe.chat_template == BPE_CHAT_TEMPLATE
    assert sp.chat_template == SP_CHAT_TEMPLATE
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    bpe_text = bpe.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    sp_text = sp.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert bpe_text == "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n"
    assert sp_text == "<s><start_of_turn>user\nWhat is 6 * 7?<end_of_turn>\n<start_of_turn>model\n"
    # Chat markers are single special tokens, as in the real models.
    im_start = bpe.convert_tokens_to_ids("<|im_start|>")
    assert bpe.encode(bpe_text)[0] == im_start
    assert sp.encode(sp_text, add_special_tokens=False)[:2] == [
        sp.bos_token_id,
        sp.convert_tokens_to_ids("<start_of_turn>"),
    ]


@pytest.mark.parametrize(
    ("folder_fixture", "parts_fixture"),
    [("tiny_bpe_dir", "_tiny_bpe_parts"), ("tiny_sp_dir", "_tiny_sp_parts")],
)
def test_reload_offline_gives_identical_logits(
    folder_fixture: str, parts_fixture: str, request: pytest.FixtureRequest
) -> None:
    """Saved folders reload with Auto* classes and reproduce the in-memory model exactly."""
    folder: Path = request.getfixturevalue(folder_fixture)
    tok, model = request.getfixturevalue(parts_fixture)
    reloaded_tok = _load_tokenizer(folder)
    reloaded = _load_model(folder)
    assert reloaded_tok.get_vocab() == tok.get_vocab()
    assert reloaded.dtype == torch.float32
    assert reloaded.config.vocab_size == len(tok)
    assert reloaded.config.tie_word_embeddings is False
    assert reloaded.config.bos_token_id == tok.bos_token_id
    assert reloaded.config.eos_token_id == tok.eos_token_id
    assert reloaded.config.pad_token_id == tok.pad_token_id

    batch = reloaded_tok(DEFAULT_CORPUS[:4], return_tensors="pt", padding=True)
    with torch.no_grad():
        original_logits = model(**batch).logits
        reloaded_logits = reloaded(**batch).logits
    assert torch.allclose(original_logits, reloaded_logits)


def test_padded_model_has_extra_embedding_rows(tiny_bpe_padded_dir: Path) -> None:
    """Qwen-like: the model scores ids the tokenizer cannot produce or decode."""
    tok = _load_tokenizer(tiny_bpe_padded_dir)
    model = _load_model(tiny_bpe_padded_dir)
    assert model.get_input_embeddings().weight.shape[0] == len(tok) + 37
    assert model.get_output_embeddings().weight.shape[0] == len(tok) + 37
    batch = tok("Natalia had 12 apples.", return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[-1] == len(tok) + 37


def test_perturbed_model_is_close_but_different(
    tiny_bpe_dir: Path, tiny_bpe_perturbed_dir: Path
) -> None:
    """Same tokenizer files, different weights; predictions mostly agree (it is a small nudge)."""
    assert (tiny_bpe_dir / "tokenizer.json").read_bytes() == (
        tiny_bpe_perturbed_dir / "tokenizer.json"
    ).read_bytes()
    tok = _load_tokenizer(tiny_bpe_dir)
    base, pert = _load_model(tiny_bpe_dir), _load_model(tiny_bpe_perturbed_dir)
    batch = tok(DEFAULT_CORPUS[:8], return_tensors="pt", padding=True)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        a, b = base(**batch).logits[mask], pert(**batch).logits[mask]
    assert not torch.allclose(a, b)
    agreement = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agreement > 0.5


def test_perturbed_copy_leaves_original_untouched(
    _tiny_bpe_parts: tuple[PreTrainedTokenizerFast, LlamaForCausalLM],
) -> None:
    """perturbed_copy must deep-copy; mutating the shared fixture model would leak across tests."""
    _, model = _tiny_bpe_parts
    before = model.lm_head.weight.detach().clone()
    clone = perturbed_copy(model, seed=5)
    assert torch.equal(model.lm_head.weight, before)
    assert not torch.equal(clone.lm_head.weight, before)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_not_degenerate(family: str, request: pytest.FixtureRequest) -> None:
    """Greedy decoding must produce several distinct ids, or generation tests would be vacuous."""
    folder = request.getfixturevalue(family)
    tok, model = _load_tokenizer(folder), _load_model(folder)
    batch = tok("Question: Natalia had 12 apples and bought 7 more.", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, do_sample=False)
    new_ids = out[0, batch["input_ids"].shape[1] :].tolist()
    assert len(set(new_ids)) >= 4, new_ids
    # Deterministic: a second greedy run is identical.
    with torch.no_grad():
        again = model.generate(**batch, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, again)


@pytest.mark.parametrize("family", FAMILIES)
def test_distributions_are_peaky_somewhere_and_flat_elsewhere(
    family: str, request: pytest.FixtureRequest
) -> None:
    """Max next-token probability must vary a lot across positions.

    Why: logprob, greedy-match and calibration tests need both confident and uncertain
    positions; a uniform-ish random model would make them all trivially the same.
    """
    folder = request.getfixturevalue(family)
    tok, model = _load_tokenizer(folder), _load_model(folder)
    batch = tok(DEFAULT_CORPUS[:8], return_tensors="pt", padding=True)
    with torch.no_grad():
        probs = model(**batch).logits.softmax(-1)
    top = probs.max(-1).values[batch["attention_mask"].bool()]
    assert (top > 0.9).float().mean() > 0.05
    assert (top < 0.4).float().mean() > 0.05


def test_make_tiny_causal_lm_is_seeded() -> None:
    """Same seed -> same weights; different seed -> different weights."""
    tok = train_byte_bpe_tokenizer()
    a, b, c = (
        make_tiny_causal_lm(tok, seed=3),
        make_tiny_causal_lm(tok, seed=3),
        make_tiny_causal_lm(tok, seed=4),
    )
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.dtype == torch.float32
