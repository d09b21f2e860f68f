"""Each member's state in a request (docs/algorithm.md, The cycle and Caches): a verifier
re-tokenizes the committed text and keeps its KV cache across cycles; its distributions at every
boundary equal a full recompute of the same ids by the model itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import as_full, random_prompts

from lm_eval_safe.decoder.member_runs import VerifierRun
from lm_eval_safe.engines import load_member


def _full_recompute(member, prompt_ids: list[int], ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = member.engine.model(input_ids=torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 :]
    return torch.log_softmax(logits[:, : len(member.vocab)].float(), dim=-1)


@pytest.mark.parametrize("family", ["bpe", "sp"])
def test_verifier_cache_reuse_matches_full_recompute(tiny_bpe_dir: Path, tiny_sp_dir: Path, family: str) -> None:
    member = load_member(str(tiny_bpe_dir if family == "bpe" else tiny_sp_dir), device="cpu")
    prompt_ids = member.encode("the cat sat on the mat")
    reuse = VerifierRun(member, prompt_ids, reuse_cache=True)
    text = ""
    words = random_prompts(1, seed=10)[0].split() * 3
    for word in words:
        committed = len(text.encode())
        text += " " + word
        # as the decoder does: distributions at every boundary of the newly added text
        data = text.encode()
        want = set(range(committed, len(data) + 1))
        ids, ends = reuse.sync(text, data, want)
        reference = _full_recompute(member, prompt_ids, ids)
        wanted = {i for i in range(len(ids) + 1) if (ends[i - 1] if i else 0) >= committed}
        assert wanted <= set(reuse.pred), (wanted - set(reuse.pred), text)
        for i in range(len(ids) + 1):
            if i in reuse.pred:
                assert torch.allclose(as_full(reuse.pred[i]), reference[i], atol=1e-4), (i, text)
        assert len(ids) in reuse.pred
        reuse.forget_before(len(ids) - 3)
    nocache = VerifierRun(member, prompt_ids, reuse_cache=False)
    text = ""
    for word in words:
        text += " " + word
        nocache.sync(text, text.encode())
    assert reuse.recomputed < nocache.recomputed / 3
    assert reuse.recomputed >= len(ids)
