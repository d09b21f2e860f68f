"""The batch-packing replay: hand-computed schedules, brute-force limits, and the lock-step replay
against the forwards the batch driver actually ran (counted at the transformers batch's model
calls) on tiny models."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import random_prompts

from lm_eval_safe.bench.batch_packing import best_rows_apart, lock_step, packing_bound, rows_apart
from lm_eval_safe.decoder.latency import CycleForwards
from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.engines import load_member
from lm_eval_safe.engines.hf import batch as hf_batch
from lm_eval_safe.options import parse_options


def cycle(drafter: int, *verifier_forwards: int) -> CycleForwards:
    return CycleForwards(drafter=drafter, verifiers=[[1] * verifier_forwards[0]] if verifier_forwards else [[]])


def test_lock_step_by_hand() -> None:
    """A: draft 3 (its prefill first), verify prompt + window; then draft 2, verify once.
    B: draft 1 (the prefill alone), verify prompt + window. Batch 2, one round per cycle:
    round 1 drafter: 2 prefills + steps 1, 2 of A = 4; verifier: 2 prompts + one window step = 3.
    Round 2 (A alone): 2 drafter steps, 1 verifier forward."""
    a = [cycle(3, 2), cycle(2, 1)]
    b = [cycle(1, 2)]
    packed = lock_step([a, b], batch_size=2)
    assert packed.forwards == (6, 4)
    assert packed.rows == (6, 5)
    # batch 1: every forward alone
    assert lock_step([a, b], batch_size=1).forwards == (6, 5)


def test_lock_step_refills_at_a_cycles_end() -> None:
    """Batch 1 of two places, three requests: C joins when B ends (after round 1), so round 2
    batches A's second cycle with C's first."""
    a = [cycle(2, 1), cycle(2, 1)]
    b = [cycle(2, 1)]
    c = [cycle(2, 1)]
    # round 1 (A, B): drafter 2 prefills + step 1 = 3; verifier 2 prefills = 2
    # round 2 (A, C): drafter C's prefill + steps {0, 1} of A = 3; verifier C's prefill + A = 2
    assert lock_step([a, b, c], batch_size=2).forwards == (6, 4)


def test_rows_apart_by_hand() -> None:
    """A drafts 1 then verifies twice; B drafts 3 then verifies twice (prompt and window each).
    verify_at=1: step 1: drafter A, B prefills (2); step 2: drafter B, verifier A's prefill (1+1);
    step 3: drafter B, verifier A (1+1); step 4: verifier B's prefill (1); step 5: verifier B
    (1). verify_at=2: A waits until B is done drafting: 2 + 1 + 1 drafter, then verifier
    prefills 2, then one shared window forward."""
    a = [cycle(1, 2)]
    b = [cycle(3, 2)]
    assert rows_apart([a, b], 2, verify_at=1).forwards == (4, 4)
    assert rows_apart([a, b], 2, verify_at=2).forwards == (4, 3)
    assert best_rows_apart([a, b], 2) == (2, rows_apart([a, b], 2, verify_at=2))


def random_requests(rng: random.Random, count: int, verifiers: int) -> list[list[CycleForwards]]:
    requests = []
    for _ in range(count):
        cycles = []
        for index in range(rng.randint(1, 6)):
            prompt = int(index == 0)
            cycles.append(
                CycleForwards(
                    drafter=rng.randint(1 if index == 0 else 0, 6),
                    verifiers=[[1] * (prompt + rng.randint(0, 2)) for _ in range(verifiers)],
                )
            )
        requests.append(cycles)
    return requests


@pytest.mark.parametrize("seed", range(6))
def test_every_schedule_serves_every_row_and_none_beats_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    requests = random_requests(rng, rng.randint(1, 9), verifiers=rng.randint(1, 2))
    members = 1 + len(requests[0][0].verifiers)
    rows = tuple(
        sum(len(c.verifiers[m - 1]) if m else c.drafter for cycles in requests for c in cycles)
        for m in range(members)
    )
    alone = lock_step(requests, 1)
    assert alone.forwards == rows  # at batch 1 every forward runs alone
    assert rows_apart(requests, 1, verify_at=1).forwards == rows
    for batch_size in (2, 3, 8):
        bound = packing_bound(requests, batch_size)
        schedules = [lock_step(requests, batch_size)] + [
            rows_apart(requests, batch_size, at) for at in range(1, batch_size + 1)
        ]
        for packed in schedules:
            assert packed.rows == rows
            assert all(b <= f for b, f in zip(bound.forwards, packed.forwards, strict=True))
            assert all(f <= r for f, r in zip(packed.forwards, rows, strict=True))


@pytest.mark.parametrize("schedule,aggregator", [("safe", "unite"), ("safe", "gac"), ("every", "unite")])
def test_lock_step_replay_counts_the_forwards_the_driver_ran(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, schedule: str, aggregator: str, monkeypatch
) -> None:
    """The replay of a run's own cycles at its batch size gives exactly the model forwards each
    member's batch ran (prompts prefilled alone, batched steps), with rows refilled as requests
    end (7 requests, 3 rows)."""
    ran: dict[str, int] = {}
    prefill, batched = hf_batch.MemberBatch._prefill_alone, hf_batch.MemberBatch._forward

    def counting(run):
        def counted(self, *args, **kwargs):
            ran[self.member.name] = ran.get(self.member.name, 0) + 1
            return run(self, *args, **kwargs)

        return counted

    monkeypatch.setattr(hf_batch.MemberBatch, "_prefill_alone", counting(prefill))
    monkeypatch.setattr(hf_batch.MemberBatch, "_forward", counting(batched))
    specs = [str(tiny_bpe_dir), str(tiny_sp_dir)]
    members = [load_member(spec, index=i, device="cpu", dtype="float64") for i, spec in enumerate(specs)]
    options = parse_options({"members": specs, "schedule": schedule, "aggregator": aggregator})
    decoder = SafeDecoder(members, 0, options)
    jobs = [GenerationJob(p, [], 12 + 3 * i) for i, p in enumerate(random_prompts(7, seed=41))]
    for batch_size in (1, 3):
        ran.clear()
        decoder.cycle_log = []
        decoder.generate_many(jobs, batch_size)
        replayed = lock_step(decoder.cycle_log, batch_size)
        assert replayed.forwards == (ran[members[0].name], ran[members[1].name]), batch_size
        assert replayed.total < sum(replayed.rows) or batch_size == 1
