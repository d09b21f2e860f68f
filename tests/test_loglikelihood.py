"""loglikelihood against lm-eval's own ``hf`` model and a brute-force two-member reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import ll_request, make_lm

PAIRS = [
    ("The cat sat on the", " mat"),
    ("Question: 12 + 3 =", " 15"),
    ("Answer: ", "\\boxed{42}"),
    ("", "the cat sat"),
    ("café naïve", " über 数学"),
    ("numbers like 7 and 8", " sum to 15 so we write"),
]


@pytest.fixture(scope="module")
def hf_reference(request):
    from lm_eval.models.huggingface import HFLM

    def build(folder: Path) -> HFLM:
        return HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=1)

    return build


@pytest.mark.parametrize("family", ["bpe", "sp"])
def test_single_member_equals_lm_eval_hf(hf_reference, tiny_bpe_dir: Path, tiny_sp_dir: Path, family: str) -> None:
    folder = tiny_bpe_dir if family == "bpe" else tiny_sp_dir
    requests = [ll_request(c, x) for c, x in PAIRS]
    expected = hf_reference(folder).loglikelihood(requests, disable_tqdm=True)
    got = make_lm(folder).loglikelihood(requests, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(got, expected, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
        assert ga == gb


def test_same_model_twice_equals_single(tiny_bpe_dir: Path) -> None:
    requests = [ll_request(c, x) for c, x in PAIRS]
    single = make_lm(tiny_bpe_dir).loglikelihood(requests, disable_tqdm=True)
    double = make_lm(tiny_bpe_dir, tiny_bpe_dir).loglikelihood(requests, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(single, double, strict=True):
        assert a == pytest.approx(b, abs=1e-5) and ga == gb


def _token_logprobs(model, tok, context: str, continuation: str) -> tuple[list[float], list[int], bytes]:
    """Per-token log-probs of the continuation and the byte end of each token, computed here."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    cont = whole[len(ctx) :]
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0, :, : len(tok)]
    lp = torch.log_softmax(logits.float(), -1)
    values = [float(lp[len(ctx) + k - 1, t]) for k, t in enumerate(cont)]
    ends, text = [], continuation.encode()
    for k in range(1, len(cont) + 1):
        piece = tok.decode(cont[:k])
        ends.append(len(piece.encode()) if "\ufffd" not in piece else -1)
    if tok.decode(cont) != continuation:  # e.g. SentencePiece strips a leading space when decoding
        shift = len(text) - len(tok.decode(cont).encode())
        ends = [e + shift if e >= 0 else e for e in ends]
    for k in range(len(ends) - 2, -1, -1):  # half a character: belongs with the token completing it
        if ends[k] < 0:
            ends[k] = ends[k + 1]
    return values, ends, text


def test_two_tokenizers_equal_brute_force(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    refs = [(AutoModelForCausalLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)) for d in (tiny_bpe_dir, tiny_sp_dir)]
    pairs = [p for p in PAIRS if p[0]]
    got = lm.loglikelihood([ll_request(c, x) for c, x in pairs], disable_tqdm=True)
    for (context, continuation), (score, _) in zip(pairs, got, strict=True):
        per_member = [_token_logprobs(m, t, context, continuation) for m, t in refs]
        total_len = len(per_member[0][2])
        common = set(per_member[0][1]) & set(per_member[1][1])
        cuts = sorted(c for c in common if 0 < c <= total_len) or [total_len]
        if cuts[-1] != total_len:
            cuts.append(total_len)
        expected, start = 0.0, 0
        for stop in cuts:
            seg = []
            for values, ends, _ in per_member:
                seg.append(sum(v for v, e in zip(values, ends, strict=True) if start < e <= stop))
            expected += math.log(0.5 * math.exp(seg[0]) + 0.5 * math.exp(seg[1]))
            start = stop
        assert score == pytest.approx(expected, abs=1e-4), (context, continuation)
