"""Shared-prefix KV reuse across requests: outputs never depend on the store.

References are independent of the store: the same requests run with ``prefix_cache_mb=0``
(every prompt prefilled from scratch), and for the store's own bookkeeping a brute-force
longest-common-prefix over the sequences it was given.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import SCHEDULES, WORDS, gen_request, ll_request, make_lm

from lm_eval_safe.engines.hf.kv_cache import new_cache
from lm_eval_safe.engines.hf.prefix_cache import PrefixStore


def few_shot_prompts(n: int, seed: int = 0, shots: int = 3) -> list[str]:
    """Prompts sharing a long exemplar prefix, then a question of their own (as BBH's)."""
    rng = random.Random(seed)

    def sentence(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    exemplars = "".join(f"Q: {sentence(14)}\nA: {sentence(10)}.\n\n" for _ in range(shots))
    return [f"{exemplars}Q: {sentence(rng.randint(4, 12))}\nA:" for _ in range(n)]


def reused_tokens(lm) -> int:
    return sum(m.engine.prefix_store.reused_tokens for m in lm.members if m.engine.prefix_store is not None)


@pytest.mark.parametrize(("schedule", "aggregator"), SCHEDULES)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_generation_identical_with_and_without_reuse(
    tiny_bpe_dir: Path, tiny_gemma_dir: Path, schedule: str, aggregator: str, batch_size: int
) -> None:
    """Few-shot prompts (shared exemplars, sliding-window Gemma among the members): the texts
    with prefix reuse equal those with every prompt prefilled from scratch, and reuse happened."""
    requests = [
        gen_request(p, until=["\n\n"], max_gen_toks=8 + 2 * i)
        for i, p in enumerate(few_shot_prompts(5, seed=3))
    ]
    texts = {}
    for budget in (0, 64):
        lm = make_lm(
            tiny_bpe_dir,
            tiny_gemma_dir,
            schedule=schedule,
            aggregator=aggregator,
            batch_size=batch_size,
            dtype="float64",
            prefix_cache_mb=budget,
        )
        texts[budget] = lm.generate_until(requests, disable_tqdm=True)
        if budget:
            # every member: four of five prompts start from the stored exemplars
            for member in lm.members if schedule != "drafter" else lm.members[:1]:
                assert member.engine.prefix_store.reused_tokens >= 4 * 48, member.name
        else:
            assert all(m.engine.prefix_store is None for m in lm.members)
    assert texts[64] == texts[0]
    assert len(set(texts[0])) > 1


def test_scoring_identical_with_and_without_reuse(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """loglikelihood (multiple choice after shared exemplars, batch sizes 1 and 2): float32
    log-probabilities with reuse are allclose to those without, and greedy flags are equal."""
    prompts = few_shot_prompts(5, seed=7)
    choices = [" the cat", " 12 dogs", " café", " naïve answer"]
    requests = [ll_request(p, c) for p in prompts for c in choices]
    results = {}
    for budget in (0, 64):
        for batch_size in (1, 2):
            lm = make_lm(tiny_bpe_dir, tiny_sp_dir, batch_size=batch_size, prefix_cache_mb=budget)
            scores = lm.loglikelihood(requests, disable_tqdm=True)
            results[budget, batch_size] = scores
            if budget:
                assert reused_tokens(lm) > 0
    reference = results[0, 1]
    for key, scores in results.items():
        assert [g for _, g in scores] == [g for _, g in reference], key
        assert torch.allclose(
            torch.tensor([lp for lp, _ in scores]),
            torch.tensor([lp for lp, _ in reference]),
            rtol=1e-5,
            atol=1e-4,
        ), key


def test_rolling_identical_with_and_without_reuse(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    from lm_eval.api.instance import Instance

    texts = few_shot_prompts(3, seed=11)
    requests = [
        Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=0) for t in texts
    ]
    scores = {}
    for budget in (0, 64):
        lm = make_lm(tiny_bpe_dir, tiny_sp_dir, prefix_cache_mb=budget)
        scores[budget] = lm.loglikelihood_rolling(requests, disable_tqdm=True)
    assert torch.allclose(torch.tensor(scores[64]), torch.tensor(scores[0]), rtol=1e-6, atol=1e-4)


def test_small_budget_evicts_and_keeps_results(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """A budget of a few blocks: the store evicts all the time, stays within its budget after
    every request, and the texts are still those without reuse."""
    prompts = few_shot_prompts(4, seed=5) + few_shot_prompts(4, seed=6)
    requests = [gen_request(p, until=[], max_gen_toks=10) for p in prompts]
    lm_plain = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64", prefix_cache_mb=0)
    expected = lm_plain.generate_until(requests, disable_tqdm=True)
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64", prefix_cache_mb=0.05)
    budgets = []
    for member in lm.members:
        store = member.engine.prefix_store
        original = store.add

        def add(*args, _store=store, _original=original, **kwargs):
            _original(*args, **kwargs)
            budgets.append((_store.bytes, _store.budget))

        store.add = add
    texts = lm.generate_until(requests, disable_tqdm=True)
    assert texts == expected
    assert budgets and all(used <= budget for used, budget in budgets)
    assert any(used > 0 for used, _ in budgets)


def _fake_cache(ids: list[int], layers: int = 2) -> object:
    """A cache whose states encode each token id and position, so a reused block can be checked
    against the ids it claims to hold."""
    states = []
    for layer in range(layers):
        keys = torch.tensor([[float(i), float(p), float(layer)] for p, i in enumerate(ids)])
        states.append((keys[None, None], -keys[None, None]))
    return new_cache(states)


def test_store_matches_brute_force_longest_prefix() -> None:
    """Random id sequences with shared prefixes (and seams where they diverge mid-block): the
    reused length is the longest common prefix with any stored sequence, rounded down to whole
    blocks and leaving one token to feed; the returned states are those of exactly those ids."""
    rng = random.Random(0)
    store = PrefixStore(budget=1 << 30, block=4)
    stored: list[list[int]] = []
    stems = [[rng.randrange(50) for _ in range(rng.randint(5, 30))] for _ in range(4)]
    for _ in range(200):
        stem = rng.choice(stems)
        ids = stem[: rng.randint(0, len(stem))] + [rng.randrange(50) for _ in range(rng.randint(1, 12))]
        expected = 0
        for old in stored:
            common = 0
            while common < min(len(old), len(ids)) and old[common] == ids[common]:
                common += 1
            expected = max(expected, common)
        expected = min(expected, len(ids) - 1) // 4 * 4
        reused, cache = store.lookup(ids)
        assert reused == expected
        if reused:
            keys = cache.layers[1].keys[0, 0]
            assert keys[:, 0].tolist() == [float(i) for i in ids[:reused]]
            assert keys[:, 1].tolist() == [float(p) for p in range(reused)]
        store.add(ids, _fake_cache(ids))
        stored.append(ids)


def test_text_shared_prefix_split_differently_at_the_seam(tiny_bpe_dir: Path) -> None:
    """Two prompts share a text prefix whose last word the byte-level BPE merges with what
    follows in only one of them: reuse stops at the last block where the ids agree, and the
    next-token distribution equals a fresh prefill's."""
    from lm_eval_safe.engines import load_member
    from lm_eval_safe.engines.hf.forward import forward_logprobs

    member = load_member(str(tiny_bpe_dir), device="cpu", dtype="float64")
    shared = few_shot_prompts(1, seed=2)[0] + " the"
    first, second = shared + " cat sat", shared + "re were 45 apples"
    ids_a, ids_b = member.encode(first), member.encode(second)
    common = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=False)) if a != b)
    assert member.tokenizer.decode(ids_b[:common]) != shared, "the seam must split differently"
    store = member.engine.prefix_store
    reused_a, cache_a = store.lookup(ids_a)
    forward_logprobs(member, ids_a[reused_a:], cache_a, 1)
    store.add(ids_a, cache_a)
    reused_b, cache_b = store.lookup(ids_b)
    assert 0 < reused_b <= common
    assert reused_b > common - store.block
    reused_row = forward_logprobs(member, ids_b[reused_b:], cache_b, 1)
    fresh_row = forward_logprobs(member, ids_b, new_cache(), 1)
    assert torch.allclose(reused_row, fresh_row, atol=1e-10)


def test_safe_stats_report_prefill_tokens_saved(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    prompts = few_shot_prompts(4, seed=9)
    lm.generate_until([gen_request(p, until=[], max_gen_toks=4) for p in prompts], disable_tqdm=True)
    stats = lm.get_model_info()["safe_stats"]
    assert stats["prefill_tokens_saved"] == reused_tokens(lm) > 0
    assert stats["prefill_tokens"] >= stats["prefill_tokens_saved"] + len(prompts)


def test_bad_budget_fails_in_one_line(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    from lm_eval_safe.errors import OptionError

    with pytest.raises(OptionError, match="prefix_cache_mb"):
        make_lm(tiny_bpe_dir, tiny_sp_dir, prefix_cache_mb=-1)


@pytest.mark.parametrize("family", ["bpe", "gemma"])
def test_scored_contexts_store_their_own_states(
    tiny_bpe_dir: Path, tiny_gemma_dir: Path, family: str
) -> None:
    """Contexts of different lengths and different exemplars scored in one left-padded batch,
    then again from the store: every stored block holds the states a fresh prefill of that
    context computes (row and padding offset right), on both the batched and the reuse path."""
    from lm_eval_safe.engines import load_member
    from lm_eval_safe.engines.hf.scoring import score_tokens

    member = load_member(
        str(tiny_bpe_dir if family == "bpe" else tiny_gemma_dir), device="cpu", dtype="float64"
    )
    contexts = [few_shot_prompts(1, seed=s, shots=2 + s)[0] for s in (1, 2)]
    pairs = [(member.encode(c), member.encode(" the cat", add_special_tokens=False)) for c in contexts]
    assert len(pairs[0][0]) != len(pairs[1][0])
    store = member.engine.prefix_store
    for round_ in range(2):  # first the batched path, then the path that starts from the store
        score_tokens(member.engine, pairs, 2, 64)
        for ctx, _ in pairs:
            reused, cache = store.lookup(ctx)
            assert reused >= len(ctx) - store.block, round_
            fresh = new_cache()
            # transformers' own keyword of 4.57 (still taken, deprecated, by 5.x): independent of
            # the adapter's choice
            member.engine.model(input_ids=torch.tensor([ctx[:reused]]), past_key_values=fresh, use_cache=True)
            for mine, theirs in zip(cache.layers, fresh.layers, strict=True):
                assert torch.allclose(mine.keys, theirs.keys, atol=1e-10)
                assert torch.allclose(mine.values, theirs.values, atol=1e-10)


def test_requests_sharing_exemplars_run_together(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """Two exemplar families interleaved (as lm-eval's length order interleaves subtasks) and a
    store that holds about one family's prompt: requests run grouped by prefix, so every request
    after the first of its family still starts from the stored exemplars."""
    families = [few_shot_prompts(3, seed=s) for s in (21, 22)]
    prompts = [p for pair in zip(*families, strict=True) for p in pair]
    requests = [gen_request(p, until=[], max_gen_toks=6) for p in prompts]
    one_prompt = [0, 0]  # per member: bytes of the larger family's prompt
    for family in families:
        probe = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64")
        probe.generate_until([gen_request(family[0], until=[], max_gen_toks=1)], disable_tqdm=True)
        one_prompt = [max(n, m.engine.prefix_store.bytes) for n, m in zip(one_prompt, probe.members, strict=True)]
    shared = []  # per member: the fewest ids two prompts of one family share
    for member in probe.members:
        common = []
        for family in families:
            ids = [member.encode(p) for p in family]
            for i, a in enumerate(ids):
                for b in ids[i + 1 :]:
                    common.append(next(k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y))
        shared.append(min(common))
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64")
    for member, size in zip(lm.members, one_prompt, strict=True):
        member.engine.prefix_store.budget = int(1.4 * size)
    texts = lm.generate_until(requests, disable_tqdm=True)
    assert texts == make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64", prefix_cache_mb=0).generate_until(
        requests, disable_tqdm=True
    )
    for member, common in zip(lm.members, shared, strict=True):
        # four requests (two per family) start from all whole blocks of their family's exemplars
        block = member.engine.prefix_store.block
        assert member.engine.prefix_store.reused_tokens >= 4 * (common // block * block)


def test_eviction_drops_least_recently_used_first() -> None:
    """A budget of 10 blocks and random sequences from a few stems: after every add the store
    fits its budget, the sequence just added is whole (it fits alone, and everything else was
    used before it), and so is the one looked up just before it when both fit together."""
    rng = random.Random(1)
    block_bytes = 2 * 2 * 3 * 4 * 4  # layers x (keys, values) x 3 floats x 4 ids x 4 bytes
    store = PrefixStore(budget=10 * block_bytes, block=4)
    stems = [[rng.randrange(50) for _ in range(16)] for _ in range(3)]
    previous: list[int] | None = None
    for _ in range(300):
        ids = rng.choice(stems)[: rng.randint(4, 16)] + [rng.randrange(50) for _ in range(rng.randint(0, 12))]
        ids = ids[:24]
        store.lookup(ids)
        store.add(ids, _fake_cache(ids))
        assert store.bytes <= store.budget
        assert store.longest(ids, len(ids)) == len(ids) // 4 * 4
        if previous is not None and (len(previous) // 4 + len(ids) // 4) <= 10 and previous[:4] != ids[:4]:
            assert store.longest(previous, len(previous)) == len(previous) // 4 * 4
        previous = ids
