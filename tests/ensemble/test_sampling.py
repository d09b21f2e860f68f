"""Sampling against independent references: transformers' logits processors and
``generate(do_sample=True)``, the ensemble's distribution computed by brute force from the tiny
models' full next-token distributions, and the greedy decoder for ``temperature=0``.

Statistical tests use fixed seeds, so they are deterministic; each asserts p > 0.001 of a
chi-square test (scipy), so a correct implementation fails one with probability 0.001 per
seed choice, while the deviations they guard against (a wrong rule, a forgotten warp, sharpening
not applied) shift the distributions by far more than the tests resolve with these sample sizes.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import gen_request, hf_encode, make_lm
from scipy import stats as scipy_stats
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lm_eval_safe.ensemble.aggregate import Choice
from lm_eval_safe.ensemble.ensembler import Ensembler
from lm_eval_safe.ensemble.sampling import (
    RowSampler,
    SamplingParams,
    keep_or_resample,
    warp_logprobs,
)
from lm_eval_safe.members.vocabulary import EOS_KEY

MIN_P = 1e-3


# -- references -------------------------------------------------------------------------------


def hf_warpers(temperature: float, top_k: int = 0, top_p: float = 1.0) -> LogitsProcessorList:
    """The processors ``generate(do_sample=True, ...)`` builds, in its order."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def hf_next_probs(folder: Path, ids: list[int], **warp: Any) -> torch.Tensor:
    """transformers' own forward and warpers: the sampling distribution after ``ids``."""
    model = _hf_model(folder)
    vocab = len(AutoTokenizer.from_pretrained(folder))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[:, -1, :vocab].double()
    return torch.softmax(hf_warpers(**warp)(torch.tensor([ids]), logits), dim=-1)[0]


_HF_MODELS: dict[Path, Any] = {}


def _hf_model(folder: Path) -> Any:
    if folder not in _HF_MODELS:
        _HF_MODELS[folder] = AutoModelForCausalLM.from_pretrained(folder).eval()
    return _HF_MODELS[folder]


def by_string(probs: torch.Tensor, keys: list[bytes]) -> dict[bytes, float]:
    """A distribution over ids as one over strings (ids that spell the same string add up)."""
    out: dict[bytes, float] = {}
    for i in torch.nonzero(probs > 0).flatten().tolist():
        out[keys[i]] = out.get(keys[i], 0.0) + float(probs[i])
    return out


def brute_force_ensemble(
    drafter: dict[bytes, float],
    verifier: dict[bytes, float],
    sharpen: str,
    drafter_keys: set[bytes],
    drafter_top: list[bytes] | None = None,
    candidates: set[bytes] | None = None,
    lam: float = 0.1,
) -> dict[bytes, float]:
    """P_ens as the README defines it, from plain dictionaries: the equal-weight mixture, or where
    its maximum is below 0.5 its sharpening (the normalised geometric mean, or the heuristic
    moving each candidate's mass to the shortest absorbing string it extends), restricted to
    strings the drafter can write."""
    strings = set(drafter) | set(verifier)
    mix = {s: 0.5 * drafter.get(s, 0.0) + 0.5 * verifier.get(s, 0.0) for s in strings}
    if sharpen == "geometric" and max(mix.values()) < 0.5:
        mix = {s: math.sqrt(drafter.get(s, 0.0) * verifier.get(s, 0.0)) for s in strings}
    if sharpen == "heuristic" and max(mix.values()) < 0.5:
        assert drafter_top is not None and candidates is not None
        absorbers = [
            s
            for s in drafter_top
            if mix.get(s, 0) > lam and s.strip() and not s.startswith(b"\x00")
        ]
        moved = dict(mix)
        for c in candidates:
            prefixes = [a for a in absorbers if a != c and c.startswith(a)]
            if prefixes:
                target = min(prefixes, key=len)
                moved[target] += mix[c]
                moved[c] -= mix[c]
        mix = moved

    def sayable(s: bytes) -> bool:
        if s == EOS_KEY or s in drafter_keys:
            return True
        if s.startswith(b"\x00"):
            return False
        try:
            s.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    mix = {s: p for s, p in mix.items() if p > 0 and sayable(s)}
    total = sum(mix.values())
    return {s: p / total for s, p in mix.items()}


def chi_square(counts: Counter, expected: dict[Any, float]) -> tuple[float, float, int]:
    """Pearson's chi-square of observed counts against probabilities (statistic, p, degrees of
    freedom); outcomes with an expected count below 5 are pooled. An outcome of probability zero
    must never be observed."""
    impossible = [k for k in counts if expected.get(k, 0.0) <= 0.0]
    assert not impossible, f"observed outcomes the distribution excludes: {impossible[:5]}"
    n = sum(counts.values())
    observed, wanted, pooled_obs, pooled_exp = [], [], 0, 0.0
    for key, p in expected.items():
        if n * p >= 5:
            observed.append(counts.get(key, 0))
            wanted.append(n * p)
        else:
            pooled_obs += counts.get(key, 0)
            pooled_exp += n * p
    if pooled_exp > 0:
        observed.append(pooled_obs)
        wanted.append(pooled_exp)
    scale = n / sum(wanted)  # rounding of the probabilities
    result = scipy_stats.chisquare(observed, [w * scale for w in wanted])
    return float(result.statistic), float(result.pvalue), len(observed) - 1


# -- the parts: warping, the acceptance rule, generation kwargs ----------------------------------


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.9), (2.0, 3, 0.3), (1.0, 0, 1.0)],
)
def test_warping_matches_transformers_processors(
    temperature: float, top_k: int, top_p: float
) -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(1, 300, generator=gen, dtype=torch.float64) * 3
        if trial % 2:  # ties at the top-k cut stay, as in transformers
            logits = logits.round()
        reference = torch.softmax(hf_warpers(temperature, top_k, top_p)(None, logits.clone()), -1)[
            0
        ]
        params = SamplingParams(True, temperature, top_k, top_p)
        ours = warp_logprobs(torch.log_softmax(logits[0], -1), params).exp()
        assert torch.equal(ours > 0, reference > 0), (trial, temperature, top_k, top_p)
        torch.testing.assert_close(ours, reference, atol=1e-12, rtol=1e-9)


def test_keep_or_resample_is_distributed_as_the_target() -> None:
    """Speculative sampling's rule on fixed distributions: the kept-or-resampled index follows
    the target whatever the draft, including indices the draft never proposes."""
    gen = torch.Generator().manual_seed(1)
    draft = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64)
    target = torch.tensor([0.1, 0.3, 0.1, 0.25, 0.25], dtype=torch.float64)
    counts: Counter = Counter()
    for _ in range(20_000):
        drafted = int(torch.multinomial(draft, 1, generator=gen))
        counts[keep_or_resample(target, draft, drafted, gen)] += 1
    _, p, _ = chi_square(counts, dict(enumerate(target.tolist())))
    assert p > MIN_P


# -- exactness ---------------------------------------------------------------------------------

# (aggregator gac) prompt, verifier fixture, warping: the first generated string at its one
# aligned position, 20,000 draws through the decoder's own acceptance step
EXACTNESS_CASES = [
    ("none", "tiny_sp_dir", "the cat sat on the", {"temperature": 0.8, "top_p": 0.95}),
    (
        "heuristic",
        "tiny_gemma_dir",
        "numbers über to 12 café 15 \\boxed{42} 12",
        {"temperature": 1.0},
    ),
    ("geometric", "tiny_sp_dir", "12 while 15 or", {"temperature": 2.0}),
]


@pytest.mark.parametrize(("sharpen", "verifier_fixture", "prompt", "warp"), EXACTNESS_CASES)
def test_first_string_is_distributed_as_the_ensemble(
    request: pytest.FixtureRequest,
    tiny_bpe_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    sharpen: str,
    verifier_fixture: str,
    prompt: str,
    warp: dict[str, Any],
) -> None:
    """The decoder's acceptance step, run 20,000 times on the distributions the decoder computes
    for one prompt (drafter draw included), against P_ens computed by brute force from both
    tiny models' full distributions (transformers' forward and warpers)."""
    verifier_dir = request.getfixturevalue(verifier_fixture)
    lam = 0.001 if sharpen == "heuristic" else 0.1
    lm = make_lm(tiny_bpe_dir, verifier_dir, aggregator="gac", sharpen=sharpen, sharpen_lambda=lam)
    seen: list[Any] = []
    original = Ensembler.sample

    def record(
        self: Ensembler, views: list, drafted: int, sampler: RowSampler, test: dict | None = None
    ) -> Choice:
        seen.append(views)
        return original(self, views, drafted, sampler, test)

    monkeypatch.setattr(Ensembler, "sample", record)
    lm.generate_until([gen_request(prompt, until=[], max_gen_toks=1, do_sample=True, **warp)], True)
    monkeypatch.undo()
    assert len(seen) == 1, "the first position is always an ensemble point when sampling"
    views = seen[0]
    drafter, verifier = lm.members
    references = []
    for folder, view in zip((tiny_bpe_dir, verifier_dir), views, strict=True):
        model_type = AutoConfig.from_pretrained(folder).model_type
        ids = hf_encode(AutoTokenizer.from_pretrained(folder), prompt, model_type)
        raw = hf_next_probs(folder, ids, temperature=1.0)
        torch.testing.assert_close(view.logprobs.double().exp(), raw, atol=1e-5, rtol=1e-4)
        references.append(hf_next_probs(folder, ids, **warp))
    assert float(references[0].max()) < 0.5, "GaC's gate leaves this position open"
    p_draft = by_string(references[0], drafter.vocab.keys)
    p_verifier = by_string(references[1], verifier.vocab.keys)
    top = [
        [m.vocab.keys[i] for i in torch.topk(r, 10).indices.tolist()]
        for m, r in zip(lm.members, references, strict=True)
    ]
    expected = brute_force_ensemble(
        p_draft, p_verifier, sharpen, set(drafter.vocab.keys), top[0], set(top[0] + top[1]), lam
    )
    if sharpen != "none":
        plain = brute_force_ensemble(p_draft, p_verifier, "none", set(drafter.vocab.keys))
        moved = sum(abs(expected.get(s, 0) - plain.get(s, 0)) for s in set(expected) | set(plain))
        assert moved > 0.02, "the case must move mass, or it does not test sharpening"

    sampler = RowSampler(SamplingParams(True, **{"top_k": 0, "top_p": 1.0, **warp}), seed=2024)
    counts: Counter = Counter()
    for _ in range(20_000):
        drafted = sampler.sample(views[0].logprobs)
        counts[lm.decoder.ensembler.sample(views, drafted, sampler).key] += 1
    statistic, p, dof = chi_square(counts, expected)
    print(
        f"exactness gac/{sharpen}: chi2={statistic:.1f}, dof={dof} ({len(expected)} strings), p={p:.3f}"
    )
    assert p > MIN_P


@pytest.fixture(scope="module")
def never_aligned_dir(tmp_path_factory: pytest.TempPathFactory, tiny_sp_dir: Path) -> Path:
    """The SentencePiece-style member with a normaliser that writes "~" before every text: its
    tokens never spell the generated text, so no position after the first is aligned with it."""
    from tiny_models import save_member
    from tokenizers import normalizers

    tok = AutoTokenizer.from_pretrained(tiny_sp_dir)
    tok.backend_tokenizer.normalizer = normalizers.Sequence(
        [
            normalizers.Prepend("~"),
            normalizers.Prepend("\u2581"),
            normalizers.Replace(" ", "\u2581"),
        ]
    )
    return save_member(_hf_model(tiny_sp_dir), tok, tmp_path_factory.mktemp("never_aligned"))


def test_decoder_loop_samples_the_ensemble_then_the_drafter_where_misaligned(
    tiny_bpe_dir: Path, never_aligned_dir: Path
) -> None:
    """End to end through generate_until (600 requests, two tokens each): the first string
    follows P_ens (the generation start is aligned for every member), the second token the
    drafter's own warped distribution (misaligned: the verifier's tokens never spell the text).
    The reference enumerates every two-token text by brute force."""
    prompt = "the cat sat on the"
    warp = {"temperature": 0.9, "top_k": 3}
    n = 600
    lm = make_lm(
        tiny_bpe_dir, never_aligned_dir, aggregator="gac", sharpen="none", seed=7, batch_size=8
    )
    request = gen_request(prompt, until=[], max_gen_toks=2, do_sample=True, **warp)
    texts = lm.generate_until([request] * n, disable_tqdm=True)
    assert lm.run_stats.ensemble_ops == n and lm.run_stats.aligned_positions == n
    # the verifier is consulted (its prompt's forward gives the start's row), but no row after
    # the start can be aligned, so none of the generated text is fed to it
    assert sum(lm.run_stats.verifier_forwards.values()) == n
    assert lm.run_stats.verifier_positions == 0

    drafter, verifier = lm.members
    tok = drafter.tokenizer
    prompt_ids = hf_encode(tok, prompt)
    verifier_ids = hf_encode(verifier.tokenizer, prompt)
    first = brute_force_ensemble(
        by_string(hf_next_probs(tiny_bpe_dir, prompt_ids, **warp), drafter.vocab.keys),
        by_string(hf_next_probs(never_aligned_dir, verifier_ids, **warp), verifier.vocab.keys),
        "none",
        set(drafter.vocab.keys),
    )
    expected: dict[str, float] = {}
    for string, p_first in first.items():
        ids = lm.decoder.ensembler.to_drafter_ids(Choice(string, p_first, False), drafted=0)
        if ids[-1] in drafter.eos_ids or len(ids) >= 2:
            endings = {(): 1.0}
        else:
            second = hf_next_probs(tiny_bpe_dir, prompt_ids + ids, **warp)
            endings = {(t,): float(second[t]) for t in torch.nonzero(second > 0).flatten().tolist()}
        for ending, p_second in endings.items():
            text = tok.decode((ids + list(ending))[:2], skip_special_tokens=True)
            expected[text] = expected.get(text, 0.0) + p_first * p_second
    statistic, p, dof = chi_square(Counter(texts), expected)
    print(f"end to end: chi2={statistic:.1f}, dof={dof} ({len(expected)} texts), p={p:.3f}")
    assert p > MIN_P


def test_one_member_samples_like_transformers_generate(tiny_bpe_dir: Path) -> None:
    """A member alone draws its first token as ``generate(do_sample=True, ...)`` does: the same
    distribution (two-sample chi-square against transformers' own draws, and one-sample against
    the probabilities of transformers' warpers); no per-seed identity across libraries."""
    prompt = "the cat sat on the"
    warp = {"temperature": 1.5, "top_k": 12, "top_p": 0.9}  # both filters cut here
    n = 2000
    lm = make_lm(tiny_bpe_dir, seed=11)
    ours = Counter(
        lm.generate_until(
            [gen_request(prompt, until=[], max_gen_toks=1, do_sample=True, **warp)] * n, True
        )
    )
    tok = AutoTokenizer.from_pretrained(tiny_bpe_dir)
    ids = tok(prompt, return_tensors="pt").input_ids.repeat(n, 1)
    torch.manual_seed(0)
    out = _hf_model(tiny_bpe_dir).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        max_new_tokens=1,
        pad_token_id=tok.pad_token_id,
        **warp,
    )
    theirs = Counter(tok.decode(row[-1:], skip_special_tokens=True) for row in out)
    texts = sorted(set(ours) | set(theirs), key=lambda t: -(ours[t] + theirs[t]))
    big = [t for t in texts if ours[t] + theirs[t] >= 10]
    table = [[ours[t] for t in big], [theirs[t] for t in big]]
    rest = [n - sum(row) for row in table]
    if sum(rest):
        table = [row + [r] for row, r in zip(table, rest, strict=True)]
    two_sample = scipy_stats.chi2_contingency(table)
    probs = hf_next_probs(tiny_bpe_dir, hf_encode(tok, prompt), **warp)
    expected: dict[str, float] = {}
    for i in torch.nonzero(probs > 0).flatten().tolist():
        text = tok.decode([i], skip_special_tokens=True)
        expected[text] = expected.get(text, 0.0) + float(probs[i])
    _, one_sample, _ = chi_square(ours, expected)
    print(f"one member vs generate: p={two_sample.pvalue:.3f}, vs warpers p={one_sample:.3f}")
    assert len(big) >= 5 and len(expected) < 12, "top-k and top-p both cut this distribution"
    assert two_sample.pvalue > MIN_P and one_sample > MIN_P
