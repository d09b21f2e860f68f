"""``draft_len=auto``: the window adapts, and everything that must not
depend on the window still does not."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import gen_request, hf_greedy_text, make_lm, random_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm_eval_safe.decoder.draft_window import DraftWindow
from lm_eval_safe.errors import OptionError
from lm_eval_safe.options import parse_options


def test_window_grows_after_kept_cycles_and_shrinks_after_replacements() -> None:
    window = DraftWindow("auto")
    sizes = [window.size]
    for rejected in [False, False, False, False, True, True, True, True, True, True, False]:
        window.rejected = rejected
        window.update()
        sizes.append(window.size)
    assert sizes == [5, 7, 9, 11, 12, 11, 10, 9, 8, 7, 6, 8]
    for _ in range(20):
        window.rejected = True
        window.update()
    assert window.size == 1


def test_fixed_window_never_changes() -> None:
    window = DraftWindow(3)
    for rejected in [True, False, True]:
        window.rejected = rejected
        window.update()
        assert window.size == 3 == window.largest


def test_option_accepts_auto_and_refuses_nonsense() -> None:
    assert parse_options({"members": "a,b", "draft_len": "auto"}).draft_len == "auto"
    assert parse_options({"members": "a,b", "draft_len": "4"}).draft_len == 4
    with pytest.raises(OptionError, match="draft_len"):
        parse_options({"members": "a,b", "draft_len": "fast"})


def test_auto_alone_equals_hf_generate(tiny_bpe_dir: Path) -> None:
    """One member: the window only groups the drafter's own greedy tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_bpe_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_bpe_dir)
    lm = make_lm(tiny_bpe_dir, draft_len="auto")
    for prompt in random_prompts(3, seed=4):
        (got,) = lm.generate_until([gen_request(prompt, until=[], max_gen_toks=30)], disable_tqdm=True)
        assert got == hf_greedy_text(model, tok, prompt, 30)


@pytest.mark.parametrize("aggregator", ["unite", "gac"])
def test_auto_batched_equals_one_at_a_time(tiny_bpe_dir: Path, tiny_gemma_dir: Path, aggregator: str) -> None:
    """Each row adapts its own window: batch_size=3 gives batch_size=1's texts, and the windows
    really moved (fewer cycles than a window of 1, more drafted tokens wasted than none)."""
    requests = [gen_request(p, until=[], max_gen_toks=24) for p in random_prompts(5, seed=8)]
    texts = {}
    for bs in (1, 3):
        lm = make_lm(tiny_bpe_dir, tiny_gemma_dir, aggregator=aggregator, draft_len="auto", batch_size=bs, dtype="float64")
        texts[bs] = lm.generate_until(requests, disable_tqdm=True)
        stats = lm.run_stats
        assert stats.cycles < stats.generated_tokens
        assert stats.ensemble_ops > 0
    assert texts[3] == texts[1]
