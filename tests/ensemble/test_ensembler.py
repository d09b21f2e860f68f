"""The Ensembler's one question per ensemble point (:meth:`Ensembler.decide`) against the
paper's rules computed by brute force here, and the Aggregator interface taking a new
aggregator as one class.

Why: the loop asks ``decide`` once per point. Whether it answers from full rows, from engine
heads (widened where too short, completed where they do not settle it) or by speculative
sampling, its string must be the one the paper's rule gives on the full rows, and the engine
calls it makes (:class:`~lm_eval_safe.engines.base.Complete`) are what the engines' counters and
``safe_stats`` count. The made-up members share their strings, none a prefix of another, so
UniTE reads every member at its own token and sharpening (tested in test_aggregate.py) has
nothing to absorb: the reference is the plain weighted mean.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import gen_request, hf_encode, make_lm, random_prompts
from test_aggregate import member
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm_eval_safe import options as options_module
from lm_eval_safe.engines.base import TopLogprobs
from lm_eval_safe.ensemble import aggregators
from lm_eval_safe.ensemble.aggregate import Choice, View
from lm_eval_safe.ensemble.aggregator import Aggregator
from lm_eval_safe.ensemble.ensembler import Ensembler
from lm_eval_safe.ensemble.sampling import RowSampler, SamplingParams
from lm_eval_safe.errors import RequestError
from lm_eval_safe.options import SafeOptions

#: No string starts with another (so sharpening never moves mass).
POOL = ["The", " cat", "a", "x", "1", " dog", "\n", "sun"]
TOP_K = 3
WIDTH = 5  # head_width(top_logprobs=5, top_k=3)


def _tables(rng: random.Random, members: int) -> list[dict[str, float]]:
    """Each member's probabilities over POOL (its own id order), a couple of strong strings."""
    tables = []
    for _ in range(members):
        strings = rng.sample(POOL, len(POOL))
        logits = [rng.gauss(0.0, 1.5) + (rng.uniform(0, 2.5) if i < 2 else 0.0) for i in range(len(strings))]
        total = sum(math.exp(v) for v in logits)
        tables.append({s: math.exp(v) / total for s, v in zip(strings, logits, strict=True)})
    return tables


def paper_gac(tables: list[dict[str, float]], weights: list[float]) -> dict[str, float]:
    """GaC by the paper: the weighted mean of the members' probabilities of each string."""
    mixture: dict[str, float] = {}
    for table, weight in zip(tables, weights, strict=True):
        for string, p in table.items():
            mixture[string] = mixture.get(string, 0.0) + weight / sum(weights) * p
    return mixture


def paper_unite(tables: list[dict[str, float]], weights: list[float], k: int) -> dict[str, float]:
    """UniTE by the paper: the union of every member's k most probable strings, each member
    renormalised over it, then the weighted mean."""
    candidates = {s for t in tables for s in sorted(t, key=lambda s, t=t: -t[s])[:k]}
    mixture = dict.fromkeys(candidates, 0.0)
    for table, weight in zip(tables, weights, strict=True):
        norm = sum(table[s] for s in candidates)
        for s in candidates:
            mixture[s] += weight / sum(weights) * table[s] / norm
    return mixture


def _ensembler(views: list[View], aggregator: str, sharpen: str, tmp_path: Path) -> Ensembler:
    """An Ensembler over made-up members (a member's vocabulary, tokenizer and EOS is all it reads)."""
    stand_ins = [SimpleNamespace(vocab=v.vocab, tokenizer=v.tokenizer, eos_id=None) for v in views]
    options = SafeOptions(
        members=["d", "v"], aggregator=aggregator, sharpen=sharpen, top_k=TOP_K, top_logprobs=WIDTH,
        cache_dir=str(tmp_path),
    )  # fmt: skip
    return Ensembler(stand_ins[0], stand_ins[1:], options)  # type: ignore[arg-type]


def _head(row: torch.Tensor, width: int, known: dict[int, float] | None = None) -> TopLogprobs:
    """The row as an engine returns it: its ``width`` most probable ids (and what it knew)."""
    top = torch.topk(row, width)
    ids, logprobs = top.indices.tolist(), top.values.tolist()
    return TopLogprobs(ids, logprobs, {**(known or {}), **dict(zip(ids, logprobs, strict=True))})


def _as_heads(views: list[View], widths: list[int]) -> list[View]:
    return [View(_head(v.logprobs, w), v.vocab, v.tokenizer, v.weight) for v, w in zip(views, widths, strict=True)]


def _decide(ensembler: Ensembler, views: list[View], full: list[View], **kwargs: Any) -> tuple[Any, list[tuple[int, int]]]:
    """Runs ``decide`` to its Decision, answering each Complete as an engine does from the full
    rows; returns the decision and the calls as ``(member slot, top)``."""
    steps = ensembler.decide(views, kwargs.pop("drafted", 0), kwargs.pop("sampler", None), **kwargs)
    calls = []
    try:
        call = next(steps)
        while True:
            calls.append((call.member, call.top))
            (row,) = call.rows
            row_full = full[call.member].logprobs
            call = steps.send([_head(row_full, call.top, row.known) if call.top else row_full])
    except StopIteration as stop:
        return stop.value, calls


def _trial(rng: random.Random) -> tuple[list[dict[str, float]], list[float], list[View]]:
    tables = _tables(rng, rng.choice([2, 2, 3]))
    weights = [rng.choice([1.0, 1.0, 2.0, 0.5]) for _ in tables]
    return tables, weights, [member(t, w) for t, w in zip(tables, weights, strict=True)]


def _expected(aggregator: str, tables: list[dict[str, float]], weights: list[float]) -> dict[str, float]:
    return paper_gac(tables, weights) if aggregator == "gac" else paper_unite(tables, weights, TOP_K)


@pytest.mark.parametrize("aggregator", ["gac", "unite"])
def test_greedy_from_full_rows_is_the_papers_argmax_without_engine_calls(aggregator: str, tmp_path: Path) -> None:
    rng = random.Random(3)
    for _ in range(40):
        tables, weights, views = _trial(rng)
        decision, calls = _decide(_ensembler(views, aggregator, "heuristic", tmp_path), views, views)
        expected = _expected(aggregator, tables, weights)
        best = max(expected, key=lambda s: expected[s])
        assert calls == [] and decision.certified is None and decision.test is None
        assert decision.choice.key == best.encode() and not decision.choice.sharpened
        assert decision.choice.probability == pytest.approx(expected[best], abs=1e-9)
        assert decision.views is views


@pytest.mark.parametrize("aggregator", ["gac", "unite"])
def test_greedy_from_heads_certifies_or_completes_every_head(aggregator: str, tmp_path: Path) -> None:
    """Heads of five ids: a point the heads settle makes no engine call (certified); any other
    completes each head once, in member order (a full decision). Both give the paper's string.
    A traced point completes certified points too, without changing what is counted."""
    rng = random.Random(5)
    outcomes = Counter()
    for _ in range(80):
        tables, weights, views = _trial(rng)
        ensembler = _ensembler(views, aggregator, "none", tmp_path)
        heads = _as_heads(views, [WIDTH] * len(views))
        expected = _expected(aggregator, tables, weights)
        best = max(expected, key=lambda s: expected[s]).encode()
        decision, calls = _decide(ensembler, heads, views)
        every_head = [(slot, 0) for slot in range(len(views))]
        assert calls == ([] if decision.certified else every_head)
        assert decision.choice.key == best
        traced, traced_calls = _decide(ensembler, heads, views, traced=True)
        assert traced_calls == every_head and traced.certified == decision.certified
        assert traced.choice.key == best and all(isinstance(v.logprobs, torch.Tensor) for v in traced.views)
        outcomes[decision.certified] += 1
    assert outcomes[True] >= 10 and outcomes[False] >= 3, outcomes


@pytest.mark.parametrize(
    ("aggregator", "sharpen", "widens"),
    [("unite", "none", True), ("gac", "heuristic", True), ("gac", "none", False)],
)
def test_a_drafter_head_of_one_id_is_widened_before_rows_are_completed(
    aggregator: str, sharpen: str, widens: bool, tmp_path: Path
) -> None:
    """A drafter head of one id (a greedy draft's) cannot name top-k strings: UniTE (and GaC's
    heuristic sharpening, which reads them) first widen it to the head width with one call,
    then complete every head only if the widened heads do not settle the point. Plain GaC reads
    no top-k strings and never widens."""
    rng = random.Random(7)
    seen = Counter()
    for _ in range(60):
        tables, weights, views = _trial(rng)
        heads = _as_heads(views, [1] + [WIDTH] * (len(views) - 1))
        decision, calls = _decide(_ensembler(views, aggregator, sharpen, tmp_path), heads, views)
        widen = [(0, WIDTH)] if widens else []
        complete = [] if decision.certified else [(slot, 0) for slot in range(len(views))]
        assert calls == widen + complete
        expected = _expected(aggregator, tables, weights)
        assert decision.choice.key == max(expected, key=lambda s: expected[s]).encode()
        seen[decision.certified] += 1
    assert seen[True] >= 5 and seen[False] >= 3, seen


def _sample_many(ensembler: Ensembler, views: list[View], params: SamplingParams, n: int) -> Counter:
    sampler = RowSampler(params, seed=11)
    counts: Counter = Counter()
    for _ in range(n):
        drafted = sampler.sample(views[0].logprobs)
        decision, calls = _decide(ensembler, views, views, drafted=drafted, sampler=sampler)
        assert calls == [] and decision.certified is None
        counts[decision.choice.key.decode()] += 1
    return counts


def _assert_follows(counts: Counter, expected: dict[str, float], n: int) -> None:
    """Every string's frequency within five standard errors of its probability."""
    for string in set(counts) | set(expected):
        p = expected.get(string, 0.0)
        assert abs(counts[string] / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (string, counts, expected)


def test_sampled_gac_point_follows_the_mixture_over_strings_the_drafter_can_write(tmp_path: Path) -> None:
    """Weights 2:1. The verifier also has "ab" (the drafter writes it as "a" "b") and a special
    token the drafter cannot write: P_ens is the weighted mean without it, renormalised."""
    drafter = {"The": 0.5, " cat": 0.2, "a": 0.15, "b": 0.1, "x": 0.05}
    verifier = {" cat": 0.35, "ab": 0.25, "\x00sp": 0.2, "The": 0.1, "x": 0.1}
    views = [member(drafter, 2.0), member(verifier, 1.0)]
    mixture = paper_gac([drafter, verifier], [2.0, 1.0])
    del mixture["\x00sp"]
    expected = {s: p / sum(mixture.values()) for s, p in mixture.items()}
    n = 20_000
    counts = _sample_many(_ensembler(views, "gac", "none", tmp_path), views, SamplingParams(True, 1.0), n)
    assert counts["\x00sp"] == 0 and counts["ab"] > 0
    _assert_follows(counts, expected, n)


def test_sampled_unite_point_follows_the_warped_members_union_of_top_k(tmp_path: Path) -> None:
    """Temperature 0.8 warps each member (p ** 1.25, renormalised) before UniTE's rule; strings
    outside every member's top 3 have no probability, whatever the drafter drafted."""
    drafter = {"The": 0.3, " cat": 0.25, "a": 0.2, "x": 0.1, "1": 0.08, "sun": 0.07}
    verifier = {"x": 0.35, "1": 0.3, "The": 0.15, " cat": 0.1, "a": 0.06, "sun": 0.04}
    warped = []
    for table in (drafter, verifier):
        powered = {s: p**1.25 for s, p in table.items()}
        warped.append({s: p / sum(powered.values()) for s, p in powered.items()})
    expected = paper_unite(warped, [1.0, 1.0], TOP_K)
    views = [member(drafter), member(verifier)]
    n = 6_000
    counts = _sample_many(_ensembler(views, "unite", "none", tmp_path), views, SamplingParams(True, 0.8), n)
    assert set(expected) == {"The", " cat", "a", "x", "1"}  # by hand: each member's top 3
    assert counts["sun"] == 0 and counts["1"] > 0
    _assert_follows(counts, expected, n)


class SecondChoice(Aggregator):
    """A fifth aggregator: the drafter's second most probable token, whatever the verifiers
    say. Nothing but this class and one registry entry."""

    def __init__(self, drafter: Any, verifiers: list[Any], options: SafeOptions) -> None:
        self.asked = 0

    def choose(self, views: list[View]) -> Choice:
        self.asked += 1
        row = views[0].logprobs
        second = int(torch.topk(row, 2).indices[1])
        return Choice(views[0].vocab.keys[second], float(row[second].exp()), False, [second])

    def candidates(self, views: list[View]) -> list[list[Any]]:
        return []

    def written_ids(self, encoded: list[int]) -> list[int]:
        return encoded


def _second_choice_text(folder: Path, prompt: str, steps: int) -> str:
    """transformers' forward, taking the second most probable token at every step."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = hf_encode(tokenizer, prompt)
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids + generated])).logits[0, -1]
            generated.append(int(torch.topk(logits, 2).indices[1]))
            if generated[-1] == tokenizer.eos_token_id:
                break
    return tokenizer.decode(generated, skip_special_tokens=True)


def test_a_fifth_aggregator_is_one_class_behind_the_interface(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered under a new name, it decides every point of ``schedule=every`` (each drafted
    token): the text is the drafter's second choice at every step, as a loop over transformers'
    forward takes it. A sampled request reaches its missing sampled rule and is refused as the
    interface says."""
    monkeypatch.setattr(options_module, "AGGREGATORS", (*options_module.AGGREGATORS, "second"))
    monkeypatch.setitem(aggregators.AGGREGATORS, ("paper", "second"), SecondChoice)
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, schedule="every", aggregator="second")
    for prompt in random_prompts(3, seed=9):
        (got,) = lm.generate_until([gen_request(prompt, until=[], max_gen_toks=12)], disable_tqdm=True)
        assert got == _second_choice_text(tiny_bpe_dir, prompt, 12)
    assert lm.decoder.ensembler.aggregator.asked == lm.run_stats.ensemble_ops >= 3 * 12
    sampled = gen_request("the cat", until=[], max_gen_toks=4, do_sample=True, temperature=0.7)
    with pytest.raises(RequestError, match="no sampled rule"):
        lm.generate_until([sampled], disable_tqdm=True)
