"""When to ensemble (docs/algorithm.md, Schedules and Consensus): each schedule against an
independent reference: transformers' greedy ``generate`` where the ensemble cannot change the
drafter's text, and the paper's Theorem 1 (where SAFE skips, the plain average agrees, so SAFE
equals ensembling at every aligned position)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import gen_request, hf_greedy_text, make_lm, random_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def bpe_reference(tiny_bpe_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_bpe_dir).eval(), AutoTokenizer.from_pretrained(tiny_bpe_dir)


def test_ensemble_keeping_the_drafted_token_never_redrafts(
    tiny_bpe_dir: Path, tiny_bpe_perturbed_dir: Path, bpe_reference
) -> None:
    """With the verifier's weight at 0, every ensemble (``aligned``: at every aligned position)
    picks the drafter's own token; the tokens drafted after it are then kept, not drafted
    again, so the drafter runs exactly once per generated token and says what it says alone."""
    lm = make_lm(
        tiny_bpe_dir,
        tiny_bpe_perturbed_dir,
        schedule="aligned",
        aggregator="unite",
        sharpen="none",
        weights="1,0",
    )
    model, tok = bpe_reference
    for prompt in random_prompts(6, seed=6):
        (got,) = lm.generate_until([gen_request(prompt, until=[], max_gen_toks=24)], disable_tqdm=True)
        assert got == hf_greedy_text(model, tok, prompt, 24)
    stats = lm.run_stats
    assert stats.ensemble_ops >= 3
    assert stats.drafted_tokens == stats.generated_tokens
    assert stats.accepted_tokens == stats.generated_tokens


@pytest.mark.parametrize("schedule", ["drafter", "safe", "aligned"])
def test_same_model_twice_equals_hf_generate(tiny_bpe_dir: Path, bpe_reference, schedule: str) -> None:
    """Identical members agree at every aligned position, so schedules that only ensemble there
    cannot change the drafter's greedy text. (``every``/``threshold`` also ensemble at misaligned,
    OOV-like positions, where even a copy of the drafter sees a different tokenization: that is
    the baseline's known failure, not a property to test.)"""
    lm = make_lm(tiny_bpe_dir, tiny_bpe_dir, schedule=schedule, aggregator="unite", sharpen="none")
    model, tok = bpe_reference
    for prompt in random_prompts(3, seed=5):
        (got,) = lm.generate_until([gen_request(prompt, until=[], max_gen_toks=20)], disable_tqdm=True)
        assert got == hf_greedy_text(model, tok, prompt, 20)


def test_theorem1_safe_equals_every_aligned_position(tiny_bpe_dir: Path, tiny_bpe_perturbed_dir: Path) -> None:
    """Paper's Theorem 1: with the plain average (unite, no sharpening) skipping at consensus
    never changes the output, so SAFE equals ensembling at every aligned position."""
    opts = {"aggregator": "unite", "sharpen": "none"}
    safe = make_lm(tiny_bpe_dir, tiny_bpe_perturbed_dir, schedule="safe", **opts)
    aligned = make_lm(tiny_bpe_dir, tiny_bpe_perturbed_dir, schedule="aligned", **opts)
    prompts = random_prompts(25, seed=6)
    requests = [gen_request(p, until=[], max_gen_toks=24) for p in prompts]
    assert safe.generate_until(requests, disable_tqdm=True) == aligned.generate_until(requests, disable_tqdm=True)
    assert safe.run_stats.ensemble_ops > 0, "the test needs positions where the members disagree"
    assert aligned.run_stats.ensemble_ops > safe.run_stats.ensemble_ops


def test_theorem1_safe_equals_every_token(tiny_bpe_dir: Path, tiny_bpe_perturbed_dir: Path) -> None:
    """Same tokenizer: on requests where the every-token baseline never ensembled at a
    misaligned (OOV-like) position, SAFE must give exactly its output. A greedy drafter can emit
    non-canonical tokenizations (two tokens where the tokenizer has one); there ``every`` feeds
    the verifier an OOV-like prefix, which is the failure SAFE exists to avoid."""
    opts = {"aggregator": "unite", "sharpen": "none"}
    safe = make_lm(tiny_bpe_dir, tiny_bpe_perturbed_dir, schedule="safe", **opts)
    every = make_lm(tiny_bpe_dir, tiny_bpe_perturbed_dir, schedule="every", **opts)
    compared = 0
    for prompt in random_prompts(40, seed=7):
        request = [gen_request(prompt, until=[], max_gen_toks=16)]
        (a,) = every.generate_until(request, disable_tqdm=True)
        if every.request_stats[-1]["misaligned_ensembles"]:
            continue
        (b,) = safe.generate_until(request, disable_tqdm=True)
        assert a == b
        compared += 1
    assert compared >= 5
    assert every.run_stats.ensemble_rate == pytest.approx(100.0)
    assert safe.run_stats.ensemble_rate < 100.0
