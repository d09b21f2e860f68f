"""Verification beside the next draft (``overlap=``), forward counts and the depth model, and
verifier positions fed once.

References: ``overlap=off`` (itself tested against transformers' ``generate`` and brute force
elsewhere) for the texts; forwards counted at ``MemberBatch.forward`` for the forward counts; hand
computed timelines for the depth model. Models run in float64 where texts must be equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SCHEDULES, gen_request, make_lm, random_prompts

from lm_eval_safe.decoder import batch_driver
from lm_eval_safe.decoder.latency import CycleForwards, forward_depth
from lm_eval_safe.decoder.overlap import overlap_enabled
from lm_eval_safe.engines.hf import batch as hf_batch
from lm_eval_safe.errors import OptionError
from lm_eval_safe.options import parse_options

# what overlap changes: forwards drafted ahead, so engine calls too, and the times
FORWARD_COUNTS = {
    "drafter_forwards",
    "speculative_dropped",
    "wall_seconds",
    "tokens_per_second",
    "engine_calls",
    "engine_calls_per_token",
    "engine_seconds",
    "engine_seconds_by_member",
    "host_ms_per_token",
}


def _run(members: list[Path], prompts: list[str], **options):
    lm = make_lm(*members, dtype="float64", **options)
    texts = lm.generate_until([gen_request(p, until=[], max_gen_toks=24) for p in prompts], disable_tqdm=True)
    return texts, lm.get_model_info()["safe_stats"]


@pytest.mark.parametrize("verifier_done", ["never", "at_once"])
@pytest.mark.parametrize("schedule,aggregator", [s for s in SCHEDULES if s[0] != "drafter"])
def test_overlap_gives_the_texts_of_overlap_off(
    tiny_bpe_dir: Path, tiny_gemma_dir: Path, schedule: str, aggregator: str, verifier_done: str, monkeypatch
) -> None:
    """However long the verifier takes (``never`` done: the drafter drafts the whole next window
    ahead; ``at_once``: nothing ahead), every text and every decision is that of overlap=off, at
    batch size 1 and 3; only the drafter's forward count grows by the tokens rolled back."""
    prompts = random_prompts(5, seed=31)
    members = [tiny_bpe_dir, tiny_gemma_dir]
    common = {"schedule": schedule, "aggregator": aggregator}
    served = {"rows": 0}  # drafter rows the drafter's batch ran, prefills included
    run = hf_batch.MemberBatch.forward

    def counted(self, calls, *fed):
        if self.member.name == tiny_bpe_dir.name:
            served["rows"] += len(calls)
        return run(self, calls, *fed)

    monkeypatch.setattr(hf_batch.MemberBatch, "forward", counted)
    for bs in (1, 3):
        served["rows"] = 0
        off_texts, off = _run(members, prompts, overlap="off", batch_size=bs, **common)
        assert off["drafter_forwards"] == served["rows"] == off["drafted_tokens"]
        assert off["speculative_dropped"] == 0
        served["rows"] = 0
        with monkeypatch.context() as patch:
            patch.setattr(batch_driver.Pending, "done", lambda self: verifier_done == "at_once")
            on_texts, on = _run(members, prompts, overlap="on", batch_size=bs, **common)
        assert on_texts == off_texts
        assert {k: v for k, v in on.items() if k not in FORWARD_COUNTS} == {
            k: v for k, v in off.items() if k not in FORWARD_COUNTS
        }
        assert on["drafter_forwards"] == served["rows"]
        if verifier_done == "at_once":
            assert on["speculative_dropped"] == 0
        elif off["ensemble_replaced"]:
            assert on["speculative_dropped"] > 0, "a replaced window must drop what was drafted ahead"


def test_overlap_three_members_and_sampling(tiny_bpe_dir: Path, tiny_sp_dir: Path, tiny_gemma_dir: Path, monkeypatch) -> None:
    """Two verifier threads; sampled requests never draft ahead (their draws would reorder), so
    they too match overlap=off exactly."""
    monkeypatch.setattr(batch_driver.Pending, "done", lambda self: False)
    prompts = random_prompts(4, seed=32)
    members = [tiny_sp_dir, tiny_bpe_dir, tiny_gemma_dir]
    for extra in ({}, {"do_sample": True, "temperature": 0.9}):
        requests = [gen_request(p, until=[], max_gen_toks=16, **extra) for p in prompts]
        texts = {}
        for mode in ("off", "on"):
            lm = make_lm(*members, dtype="float64", overlap=mode, batch_size=2, seed=5)
            texts[mode] = lm.generate_until(requests, disable_tqdm=True)
            stats = lm.get_model_info()["safe_stats"]
            assert stats["ensemble_ops"] > 0
            if extra:
                assert stats["speculative_dropped"] == 0 and stats["drafter_forwards"] == stats["drafted_tokens"]
        assert texts["on"] == texts["off"]


def test_forward_counts_match_the_forwards_run(tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch) -> None:
    """``drafter_forwards``/``verifier_forwards`` are the forwards each member's batch ran, and
    the sequential depth of a lone request is their sum."""
    calls: dict[str, int] = {}
    run = hf_batch.MemberBatch.forward

    def counted(self, requests, *fed):
        calls[self.member.name] = calls.get(self.member.name, 0) + 1
        return run(self, requests, *fed)

    monkeypatch.setattr(hf_batch.MemberBatch, "forward", counted)
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64")
    lm.generate_until([gen_request(random_prompts(1, seed=33)[0], until=[], max_gen_toks=30)], disable_tqdm=True)
    stats = lm.get_model_info()["safe_stats"]
    drafter, verifier = (m.name for m in lm.members)
    assert stats["drafter_forwards"] == calls[drafter]
    assert stats["verifier_forwards"] == {verifier: calls[verifier]}
    assert stats["forward_depth"] == calls[drafter] + calls[verifier]
    assert stats["forward_depth"] >= stats["forward_depth_overlapped"] >= calls[drafter]
    assert stats["forward_depth_per_token"] == round(stats["forward_depth"] / stats["generated_tokens"], 4)
    by_member = stats["engine_seconds_by_member"]
    assert set(by_member) == {drafter, verifier} and min(by_member.values()) > 0
    assert abs(sum(by_member.values()) - stats["engine_seconds"]) < 0.01


def test_depth_model_on_hand_computed_timelines() -> None:
    kept = CycleForwards(drafter=5, verifiers=[[5]])
    replaced = CycleForwards(drafter=5, verifiers=[[5]], replaced=True)
    # draft 5 | verify 1 hidden under the next draft 5 | verify 1 waited for | draft 3 | verify 2 at the end
    cycles = [kept, replaced, CycleForwards(drafter=3, verifiers=[[4, 1]])]
    assert forward_depth(cycles) == (5 + 1 + 5 + 1 + 3 + 2, 5 + 5 + 1 + 3 + 2)
    # a verification longer than the next draft shows its excess; two verifiers run at once
    slow = [CycleForwards(drafter=1, verifiers=[[1], [1, 1, 1]]), CycleForwards(drafter=1, verifiers=[[], []])]
    assert forward_depth(slow) == (1 + 4 + 1, 1 + 1 + (3 - 1))
    # latencies instead of counts: the drafter's forward costs 2, a verifier row 0.5
    cost = lambda member, rows: 2.0 if member == 0 else 0.5 * rows  # noqa: E731
    assert forward_depth([kept, kept], cost) == (10 + 2.5 + 10 + 2.5, 10 + 10 + 2.5)


@pytest.mark.parametrize("pair", ["same_tokenizer", "other_tokenizer"])
def test_no_verifier_position_fed_twice(
    tiny_bpe_dir: Path, tiny_bpe_perturbed_dir: Path, tiny_sp_dir: Path, pair: str, monkeypatch
) -> None:
    """A verifier token whose prefix and id are unchanged is never fed again: each feed is
    replayed on a model of the verifier's cache, and a position fed with the same prefix as the
    cache already held is a recomputed row. With one tokenizer for both members no token is
    ever re-merged, so every re-fed position would be a wasted one (the code before fed the
    previous window's last token again: this test fails on it); with another tokenizer, BPE
    re-merges at a window's end are the only positions fed again, with a changed prefix."""
    verifier_dir = tiny_bpe_perturbed_dir if pair == "same_tokenizer" else tiny_sp_dir
    cached: dict[int, list[int]] = {}
    refed = fed = 0
    run = hf_batch.MemberBatch.forward

    def replayed(self, requests, *device_fed):
        nonlocal refed, fed
        if self.member.name == verifier_dir.name:
            for row, call in requests.items():
                before = cached.get(row, []) if call.keep else []  # keep=0: a new request
                after = before[: call.keep] + list(call.ids)
                same = 0
                while same < min(len(before), len(after)) and before[same] == after[same]:
                    same += 1
                refed += max(0, same - call.keep)
                fed += len(call.ids)
                cached[row] = after
        return run(self, requests, *device_fed)

    monkeypatch.setattr(hf_batch.MemberBatch, "forward", replayed)
    lm = make_lm(tiny_bpe_dir, verifier_dir, dtype="float64", schedule="aligned")
    lm.generate_until([gen_request(p, until=[], max_gen_toks=30) for p in random_prompts(3, seed=34)], disable_tqdm=True)
    assert fed > 0 and lm.run_stats.ensemble_ops > 0
    assert refed == 0


def test_overlap_option() -> None:
    assert parse_options({"members": "a,b"}).overlap == "auto"
    assert parse_options({"members": "a,b", "overlap": "on"}).overlap == "on"
    with pytest.raises(OptionError, match="overlap"):
        parse_options({"members": "a,b", "overlap": "sometimes"})


def test_overlap_auto_only_across_gpus(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    drafter, verifier = lm.members
    assert not overlap_enabled("auto", drafter, [verifier])  # CPU: the members share the cores
    assert overlap_enabled("on", drafter, [verifier]) and not overlap_enabled("off", drafter, [verifier])
