"""The decoder loop against independent references: transformers' greedy ``generate`` and
lm-eval's ``hf`` model (stop strings, budgets, truncation, chat templates, members of different
tokenizers). When to ensemble: tests/decoder/test_schedules.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import gen_request, hf_greedy_text, make_lm, random_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def bpe_single(tiny_bpe_dir: Path):
    return make_lm(tiny_bpe_dir)


@pytest.fixture(scope="module")
def bpe_reference(tiny_bpe_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_bpe_dir).eval(), AutoTokenizer.from_pretrained(tiny_bpe_dir)


@pytest.mark.parametrize("prompt", random_prompts(6, seed=1))
def test_single_member_equals_hf_generate(bpe_single, bpe_reference, prompt: str) -> None:
    model, tok = bpe_reference
    expected = hf_greedy_text(model, tok, prompt, 24)
    (got,) = bpe_single.generate_until([gen_request(prompt, until=[], max_gen_toks=24)], disable_tqdm=True)
    assert got == expected


def test_stop_strings_cut_like_reference(bpe_single, bpe_reference) -> None:
    """One-character and multi-token stop strings: cut at the earliest occurrence, never past it."""
    model, tok = bpe_reference
    checked = 0
    for prompt in random_prompts(8, seed=2):
        full = hf_greedy_text(model, tok, prompt, 40)
        visible = [c for c in full[3:] if not c.isspace()]
        if len(visible) < 2:
            continue
        one_char = visible[len(visible) // 2]
        multi = full[len(full) // 2 : len(full) // 2 + 4]
        for stop in ([one_char], [multi, "\x01never"]):
            expected = full
            for s in stop:
                expected = expected.split(s)[0]
            (got,) = bpe_single.generate_until(
                [gen_request(prompt, until=stop, max_gen_toks=40)], disable_tqdm=True
            )
            assert got == expected
            checked += 1
    assert checked >= 8


def test_max_gen_toks_aliases_and_budget(bpe_single, bpe_reference) -> None:
    model, tok = bpe_reference
    prompt = "the cat sat on"
    for key in ("max_gen_toks", "max_new_tokens", "max_tokens"):
        (got,) = bpe_single.generate_until([gen_request(prompt, until=[], **{key: 7})], disable_tqdm=True)
        assert got == hf_greedy_text(model, tok, prompt, 7)


def test_single_member_equals_lm_eval_hf_generate(tiny_bpe_dir: Path, bpe_single) -> None:
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(tiny_bpe_dir), device="cpu", dtype="float32", batch_size=1)
    requests = [gen_request(p, until=["\n\n", "7"], max_gen_toks=20) for p in random_prompts(4, seed=3)]
    assert bpe_single.generate_until(requests, disable_tqdm=True) == hf.generate_until(requests, disable_tqdm=True)


def test_left_truncation_of_long_prompt(tiny_bpe_dir: Path, bpe_reference) -> None:
    lm = make_lm(tiny_bpe_dir, max_length=64)
    model, tok = bpe_reference
    prompt = " ".join(random_prompts(30, seed=4))
    ids = tok(prompt).input_ids
    assert len(ids) > 64
    kept = tok.decode(ids[-(64 - 8) :])
    expected_ids = model.generate(torch.tensor([ids[-(64 - 8) :]]), max_new_tokens=8, do_sample=False)
    expected = tok.decode(expected_ids[0, 56:], skip_special_tokens=True)
    assert kept
    (got,) = lm.generate_until([gen_request(prompt, until=[], max_gen_toks=8)], disable_tqdm=True)
    assert got == expected


def test_empty_prompt_is_one_line_error(bpe_single) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        bpe_single.generate_until([gen_request("", until=[], max_gen_toks=4)], disable_tqdm=True)


def test_sampling_request_is_sampled_and_unsupported_options_refused(bpe_single) -> None:
    """do_sample=True is decoded by sampling (tests/ensemble/test_sampling.py checks how); an
    option that would change the output and that we cannot honour is still refused, never
    silently dropped."""
    (text,) = bpe_single.generate_until(
        [gen_request("hi", until=[], max_gen_toks=4, do_sample=True, temperature=0.7)], disable_tqdm=True
    )
    assert isinstance(text, str)
    with pytest.raises(ValueError, match="min_p"):
        bpe_single.generate_until(
            [gen_request("hi", until=[], max_gen_toks=4, do_sample=True, temperature=0.7, min_p=0.1)],
            disable_tqdm=True,
        )


def test_different_tokenizers_run_and_report(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    for aggregator in ("gac", "unite"):
        for sharpen in ("heuristic", "geometric", "none"):
            lm = make_lm(tiny_bpe_dir, tiny_sp_dir, aggregator=aggregator, sharpen=sharpen)
            out = lm.generate_until(
                [gen_request(p, until=[], max_gen_toks=12) for p in random_prompts(3, seed=8)], disable_tqdm=True
            )
            assert all(isinstance(o, str) for o in out)
            stats = lm.run_stats
            assert stats.generated_tokens > 0 and stats.aligned_positions > 0
            assert 0.0 <= stats.acceptance_rate <= 1.0
            info = lm.get_model_info()
            assert info["safe_stats"]["generated_tokens"] == stats.generated_tokens
            assert info["aggregator"] == aggregator


def test_three_members_sp_drafter(tiny_bpe_dir: Path, tiny_sp_dir: Path, tiny_bpe_perturbed_dir: Path) -> None:
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, tiny_bpe_perturbed_dir, drafter="1")
    assert lm.drafter.name == tiny_sp_dir.name
    out = lm.generate_until([gen_request(p, until=[], max_gen_toks=16) for p in random_prompts(3, seed=9)], True)
    assert len(out) == 3 and lm.run_stats.generated_tokens > 0


def test_chat_template_rendered_per_member(tiny_bpe_dir: Path, tiny_sp_dir: Path, bpe_reference) -> None:
    """--apply_chat_template: every member sees the conversation in its own template."""
    messages = [{"role": "user", "content": "How many apples are 3 and 4?"}]
    single = make_lm(tiny_bpe_dir)
    context = single.apply_chat_template(messages, add_generation_prompt=True)
    model, tok = bpe_reference
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (got,) = single.generate_until([gen_request(context, until=[], max_gen_toks=12)], disable_tqdm=True)
    assert got == hf_greedy_text(model, tok, rendered, 12)

    pair = make_lm(tiny_bpe_dir, tiny_sp_dir)
    context = pair.apply_chat_template(messages, add_generation_prompt=True)
    for member in pair.members:
        own = member.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert pair.decoder.prompt_ids(member, context, 8) == member.encode(own)
    rendered = {m.render_context(context) for m in pair.members}
    assert len(rendered) == 2, "the two families' templates differ"


def test_member_without_chat_template_gets_plain_text(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    pair = make_lm(tiny_bpe_dir, tiny_sp_dir)
    pair.members[1].tokenizer.chat_template = None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    context = pair.apply_chat_template(messages, add_generation_prompt=True)
    assert pair.members[1].render_context(context) == "Be brief.\n\n2+2?"
    pair.members[0].tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no member has a chat template"):
        pair.apply_chat_template(messages)
