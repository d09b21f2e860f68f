"""Batched SAFE generation: a shared KV cache with per-row rollback, and ``batch_size=N``
giving exactly the text of ``batch_size=1``.

References are independent of the code under test: a full forward of each row's whole sequence
without any cache (transformers' own masks, including Gemma-3's sliding window), and the
unbatched decoder, itself tested against transformers' ``generate`` in test_generation.py.
Models run in float64 where exact equality is asserted, so a difference can only come from the
logic, not from batch-dependent float32 kernels (the float32 evidence is in BENCHMARKS.md).
"""

from __future__ import annotations

import random
from itertools import combinations, permutations
from pathlib import Path

import pytest
import torch
from helpers import SCHEDULES, completed_rows, gen_request, make_lm, random_prompts

from lm_eval_safe.decoder.batch_driver import gap_filling_order
from lm_eval_safe.engines import generation_rows, load_member
from lm_eval_safe.engines.base import Forward
from lm_eval_safe.engines.hf import cache_rows
from lm_eval_safe.engines.hf.batch import AUTO_CPU_ROWS, MemberBatch


def _full_logprobs(member, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = member.engine.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits[:, : len(member.vocab)].double(), dim=-1)


def test_gap_filling_order_moves_the_fewest_rows() -> None:
    """Every set of surviving rows of a batch of up to 7: the order keeps exactly those rows,
    and it moves as few of them as any order can (brute force over every permutation)."""
    for size in range(1, 8):
        for count in range(size + 1):
            for alive in combinations(range(size), count):
                order = gap_filling_order(list(alive))
                assert sorted(order) == list(alive)
                moved = sum(row != place for place, row in enumerate(order))
                fewest = min(
                    (sum(row != place for place, row in enumerate(p)) for p in permutations(alive)),
                    default=0,
                )
                assert moved == fewest, (alive, order)


@pytest.mark.parametrize("slack", [0, 48])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_member_batch_matches_full_recompute(
    tiny_bpe_dir: Path, tiny_gemma_dir: Path, family: str, slack: int, monkeypatch
) -> None:
    """Random appends, rollbacks, new rows and dropped rows: every returned distribution equals
    a full forward of that row's sequence. ``slack=0`` compacts the cache after every step."""
    monkeypatch.setattr(cache_rows, "_COMPACT_SLACK", slack)
    member = load_member(str(tiny_bpe_dir if family == "llama" else tiny_gemma_dir), dtype="float64")
    vocab = len(member.vocab)
    rng = random.Random(11)
    batch = MemberBatch(member)
    seqs: list[list[int]] = []
    checked = 0

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    for step in range(36):
        if batch.rows < 4 and rng.random() < 0.4:
            batch.add_row()
            seqs.append([])
        if batch.rows > 1 and rng.random() < 0.1:
            # the batch driver's order (the last rows fill the gaps), or any order
            keep = gap_filling_order(sorted(rng.sample(range(batch.rows), batch.rows - 1)))
            if rng.random() < 0.5:
                rng.shuffle(keep)
            batch.keep_rows(keep)
            seqs = [seqs[r] for r in keep]
        calls = {}
        for row, seq in enumerate(seqs):
            if not seq:
                feed = ids(rng.randint(3, 14))  # prompts longer and shorter than the window
                calls[row] = Forward(0, 0, feed, sorted(rng.sample(range(len(feed)), 2)))
            elif rng.random() < 0.8:
                keep = len(seq) if rng.random() < 0.5 else rng.randint(1, len(seq))
                feed = ids(rng.randint(1, 6))
                want = sorted(rng.sample(range(len(feed)), rng.randint(0, len(feed))))
                calls[row] = Forward(0, keep, feed, want)
        out = batch.run(calls)
        assert set(out) == set(calls)
        out = completed_rows(batch, out, calls)
        for row, call in calls.items():
            seqs[row] = seqs[row][: call.keep] + call.ids
            reference = _full_logprobs(member, seqs[row])
            assert len(call.want) == 0 or out[row].shape == (len(call.want), vocab)
            for got, i in zip(out[row], call.want, strict=True):
                torch.testing.assert_close(got.double(), reference[call.keep + i], atol=1e-8, rtol=0)
                checked += 1
        assert batch.lengths == [len(s) for s in seqs]
        # compaction keeps the cache within the slack of the longest row, plus the left padding
        # before a row's first token (prompts stay where they were spliced)
        padding = max((int((row >= 0).int().argmax()) for row in batch.positions if (row >= 0).any()), default=0)
        assert batch.slots <= max(batch.lengths, default=0) + slack + 6 + padding, step
    assert checked > 100


@pytest.mark.parametrize(("schedule", "aggregator"), SCHEDULES)
def test_batched_generation_equals_one_at_a_time(
    tiny_bpe_dir: Path, tiny_gemma_dir: Path, schedule: str, aggregator: str
) -> None:
    """batch_size=3 over 8 requests (continuous refill, per-row rollback, different lengths and
    stop strings) returns exactly batch_size=1's texts, in the original order."""
    prompts = random_prompts(8, seed=21)
    requests = [
        gen_request(p, until=["\n\n"] if i % 2 else ["."], max_gen_toks=10 + 4 * i)
        for i, p in enumerate(prompts)
    ]
    texts = {}
    for bs in (1, 3):
        lm = make_lm(
            tiny_bpe_dir,
            tiny_gemma_dir,
            schedule=schedule,
            aggregator=aggregator,
            batch_size=bs,
            dtype="float64",
        )
        texts[bs] = lm.generate_until(requests, disable_tqdm=True)
        stats = lm.run_stats
        assert stats.generated_tokens > 0
    assert texts[3] == texts[1]
    assert len(set(texts[1])) > 1, "requests must differ for the order check to mean anything"


def test_three_members_batched(tiny_bpe_dir: Path, tiny_sp_dir: Path, tiny_gemma_dir: Path) -> None:
    prompts = random_prompts(6, seed=5)
    requests = [gen_request(p, until=[], max_gen_toks=20) for p in prompts]
    texts = {}
    for bs in (1, 4):
        lm = make_lm(tiny_sp_dir, tiny_bpe_dir, tiny_gemma_dir, batch_size=bs, dtype="float64")
        texts[bs] = lm.generate_until(requests, disable_tqdm=True)
        assert lm.run_stats.ensemble_ops > 0
    assert texts[4] == texts[1]


def test_batch_size_auto_on_cpu(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, batch_size="auto")
    jobs = [("a b c", [], 8)] * 3
    assert generation_rows(lm.options, lm.members, jobs) == AUTO_CPU_ROWS
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, batch_size="auto", max_batch_size=3)
    assert generation_rows(lm.options, lm.members, jobs) == 3
