"""A vLLM member at the edge of its window, against lm-eval's own ``--model vllm``.

Why: vLLM refuses a prompt that fills ``max_model_len`` (it must generate at least one token),
so lm-eval's ``vllm`` backend keeps a loglikelihood input to ``max_length - 1`` tokens and a
rolling window to ``max_length - 2`` (left-truncated), where the transformers backends use the
whole window. A member alone on vLLM must give those numbers on prompts longer than its
window, and no call of an ensemble may submit a sequence vLLM refuses. The reference is
lm-eval's ``VLLM`` class on the same folder and engine arguments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ll_request, make_lm
from lm_eval.api.instance import Instance

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_installed")]

ENFORCE = {"enforce_eager": True, "kv_cache_memory_bytes": 16 << 20}  # engines live as long as the process: tiny caches
WINDOW = 64


@pytest.fixture(scope="module")
def short_window(tiny_bpe_vllm_dir: Path):
    """(safe-ensemble with one vLLM member, lm-eval's vllm on its folder), max_length=64."""
    from lm_eval_safe.bench.vllm_parity import lm_eval_vllm_for

    ours = make_lm(tiny_bpe_vllm_dir, engine="vllm", max_length=WINDOW, batch_size=4, **ENFORCE)
    return ours, lm_eval_vllm_for(ours.members[0], batch_size=4)


def _text_of(tokenizer, tokens: int, seed: int) -> str:
    """A text the member encodes to exactly ``tokens`` ids (cut from a longer random text)."""
    from helpers import random_prompts

    words = " ".join(random_prompts(40, seed=seed))
    ids = tokenizer.encode(words)
    assert len(ids) > tokens
    text = tokenizer.decode(ids[:tokens])
    assert len(tokenizer.encode(text)) == tokens, "the cut re-encodes to other ids"
    return text


def test_loglikelihood_past_the_window_equals_lm_eval_vllm(short_window) -> None:
    """Contexts of 80 tokens (and 61 to 63 with a 3-token continuation: the inputs around
    ``max_length - 1``), left-truncated as lm-eval's vllm truncates them."""
    ours, theirs = short_window
    tokenizer = ours.members[0].tokenizer
    requests = [ll_request(_text_of(tokenizer, n, seed=n), " the cat sat") for n in (80, 61, 62, 63, 20)]
    requests += [ll_request(_text_of(tokenizer, 80, seed=1), " and " + _text_of(tokenizer, 30, seed=2))]
    mine, reference = (lm.loglikelihood(requests, disable_tqdm=True) for lm in (ours, theirs))
    for (a, greedy_a), (b, greedy_b) in zip(mine, reference, strict=True):
        assert abs(a - b) < 1e-4 and greedy_a == greedy_b, (a, b, greedy_a, greedy_b)


def test_rolling_past_the_window_equals_lm_eval_vllm(short_window) -> None:
    """Texts of 70 and 150 tokens: windows of ``max_length - 2`` predicted tokens."""
    ours, theirs = short_window
    tokenizer = ours.members[0].tokenizer
    texts = [_text_of(tokenizer, n, seed=n) for n in (70, 150, 62, 30)]
    requests = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts]
    mine, reference = (lm.loglikelihood_rolling(requests, disable_tqdm=True) for lm in (ours, theirs))
    for a, b in zip(mine, reference, strict=True):
        assert abs(a - b) < 1e-4, (a, b)


@pytest.mark.parametrize("room", [0, 1])
def test_a_verifier_never_submits_a_full_window(short_window, room: int) -> None:
    """A verifier whose prompt and text fill the window (64 ids) runs out of it, as the decoder
    expects (it continues with the drafter alone), and one id fewer is answered: no request
    reaches vLLM's refusal."""
    from lm_eval_safe.decoder.member_runs import VerifierRun, WindowExhausted

    ours, _ = short_window
    member = ours.members[0]
    text = _text_of(member.tokenizer, 5, seed=3)
    ids = member.vocab.encode_text(member.tokenizer, text)
    prompt = member.tokenizer.encode(_text_of(member.tokenizer, 80, seed=4))[: WINDOW - room - len(ids)]
    verifier = VerifierRun(member, prompt)
    if room == 0:
        with pytest.raises(WindowExhausted):
            verifier.sync(text, text.encode("utf-8"))
    else:
        verifier.sync(text, text.encode("utf-8"))
        assert len(ids) in verifier.pred


def test_an_ensemble_runs_its_verifier_to_the_end_of_its_window(tiny_bpe_vllm_dir, tiny_sp_vllm_dir, caplog) -> None:
    """Two members on vLLM with max_length=64, every token an ensemble point, budgets that take
    a verifier's prompt and text to exactly 64 ids (these prompts do): every request finishes,
    that verifier runs out of window there and the drafter goes on alone, and the longest
    sequence any call submits is 63 ids."""
    import logging

    from helpers import gen_request, random_prompts

    lm = make_lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir, engine="vllm", max_length=WINDOW, schedule="every", batch_size=3, **ENFORCE)
    longest = [0]
    for member in lm.members:
        submit = member.engine.generate

        def spy(prompts, params, _submit=submit):
            longest[0] = max(longest[0], *(len(p) for p in prompts))
            return _submit(prompts, params)

        member.engine.generate = spy
    requests = [gen_request(p, until=[], max_gen_toks=50) for p in random_prompts(6, seed=45)]
    with caplog.at_level(logging.WARNING):
        texts = lm.generate_until(requests, disable_tqdm=True)
    assert longest[0] == WINDOW - 1 and all(texts)
    assert "ran out of context window" in caplog.text
