"""vLLM rows kept as resumable requests (sessions) against rows that re-submit whole sequences.

Why: a session sends each call only the ids its row gained, rolls itself back where the decoder
kept fewer ids than it computed, and registers prompt log-probs and seeds per chunk, all on vLLM's
own scheduler and runner objects. A session that computes anything else than a fresh request
for the whole sequence would change texts silently, so every kind of call is compared with the
re-submitting path (whole sequences through ``LLM.generate``, another code path in vLLM):
rollbacks inside a block, into a block already in the prefix cache and to nothing, verifier
windows, sampled drafts, more rows than request slots, a KV cache too small for every row's
session, and what each path submits. vLLM's private objects are reached in one module, and on a
vLLM release outside the tested ones the engine re-submits whole sequences.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from helpers import gen_request, make_lm, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_installed")]

#: no CPU compile step; a 16 MiB cache (about 1,000 ids of these tiny members per engine)
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 16 << 20}


@pytest.fixture(scope="module")
def lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir):
    return make_lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir, engine="vllm", **ENGINE)


@contextmanager
def resubmitting(engine: Any) -> Iterator[None]:
    """Batches made meanwhile submit whole sequences (open sessions stay paused)."""
    sessions = engine.sessions
    engine.sessions = None
    try:
        yield
    finally:
        engine.sessions = sessions


def decode(lm: Any, requests: list[Any], **changes: Any) -> tuple[list[str], dict[str, Any]]:
    from lm_eval_safe.decoder.loop import SafeDecoder
    from lm_eval_safe.decoder.stats import GenerationStats

    lm.options = dataclasses.replace(lm.options, **changes)
    lm.decoder = SafeDecoder(lm.members, lm.drafter_index, lm.options)
    lm.run_stats = GenerationStats()
    if "seed" in changes:
        lm.jobs.sampling_seed = changes["seed"]
    for member in lm.members:
        member.engine.forget_prefixes()
    lm._prefill_counted = [member.engine.prefill_counts() for member in lm.members]
    texts = lm.generate_until(requests, disable_tqdm=True)
    return texts, lm.run_stats.summary()


def both_ways(lm: Any, requests: list[Any], **changes: Any) -> tuple[Any, Any]:
    with_sessions = decode(lm, requests, **changes)
    for member in lm.members:
        assert member.engine.sessions.open_count == 0  # a finished run leaves no session behind
    with resubmitting(lm.members[0].engine), resubmitting(lm.members[1].engine):
        whole = decode(lm, requests, **changes)
    return with_sessions, whole


def assert_same_heads(got: list[Any], want: list[Any]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.ids == b.ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_rolled_back_drafts_equal_fresh_requests(lm) -> None:
    """Drafts after keeping fewer ids than the session computed: inside its open block, inside a
    block already in the prefix cache (the session backs off to the block's start), short of
    the first block (the session starts again), and keeping all."""
    from lm_eval_safe.engines.base import Draft

    member = lm.members[0]
    engine = member.engine
    rng = random.Random(5)
    prompt = [rng.randrange(10, 300) for _ in range(60)]
    batch = engine.new_batch()
    batch.add_row()
    first = batch.run({0: Draft(0, 0, prompt, 12)})[0]
    assert len(first.tokens) == 12  # 72 ids, 71 computed: blocks 0 and 1 are in the prefix cache
    for keep, fed in [(70, 17), (62, 33), (65, 40), (20, 41), (None, 42), (None, 43)]:
        keep = len(batch.rows[0]) if keep is None else keep
        sequence = batch.rows[0][:keep] + [fed]
        got = batch.run({0: Draft(0, keep, [fed], 6)})[0]
        with resubmitting(engine):
            fresh = engine.new_batch()
            fresh.add_row()
            want = fresh.run({0: Draft(0, 0, sequence, 6)})[0]
        assert got.tokens == want.tokens, keep
        assert_same_heads(got.rows, want.rows)
    batch.keep_rows([])
    assert engine.sessions.open_count == 0


def test_verifier_windows_equal_whole_sequences(lm) -> None:
    """Forwards as a verifier makes them: the prompt, then windows with inner positions, each
    after rejecting part of the last one."""
    from lm_eval_safe.engines.base import Forward

    engine = lm.members[1].engine
    rng = random.Random(9)
    prompt = [rng.randrange(10, 300) for _ in range(45)]
    calls = [Forward(1, 0, prompt, [len(prompt) - 1])]
    held = len(prompt)
    for accepted in (3, 0, 5, 1):
        window = [rng.randrange(10, 300) for _ in range(6)]
        calls.append(Forward(1, held, window, [0, 2, 5]))
        held += accepted
    batch = engine.new_batch()
    batch.add_row()
    for call in calls:
        sequence = batch.rows[0][: call.keep] + call.ids
        got = batch.run({0: call})[0]
        with resubmitting(engine):
            fresh = engine.new_batch()
            fresh.add_row()
            want = fresh.run({0: Forward(1, 0, sequence, [call.keep + w for w in call.want])})[0]
        assert_same_heads(got, want)
    batch.keep_rows([])
    assert engine.sessions.open_count == 0


def test_greedy_texts_and_costs(lm) -> None:
    requests = [gen_request(p, until=["\n\n"], max_gen_toks=32) for p in random_prompts(6, seed=31)]
    (texts, stats), (whole_texts, whole_stats) = both_ways(lm, requests, schedule="safe", aggregator="unite", batch_size=3)
    assert texts == whole_texts
    for key in ("generated_tokens", "ensemble_ops", "cycles", "drafted_tokens"):
        assert stats[key] == whole_stats[key], key
    # a session sends what its row gained; re-submission sends every sequence every call
    assert stats["submitted_tokens_per_token"] * 3 < whole_stats["submitted_tokens_per_token"]
    assert stats["computed_prefill_per_token"] < whole_stats["computed_prefill_per_token"]


def test_sampled_texts_equal_resubmitted(lm) -> None:
    """Each window's seed reaches a resumed chunk as it reaches a new request."""
    requests = [
        gen_request(p, until=[], max_gen_toks=20, do_sample=True, temperature=0.8, top_p=0.9)
        for p in random_prompts(3, seed=23)
    ]
    (texts, _), (whole_texts, _) = both_ways(lm, requests, schedule="safe", aggregator="gac", batch_size=3, seed=3)
    assert texts == whole_texts


def test_more_rows_than_slots_and_a_small_cache(tiny_bpe_vllm_dir, tiny_sp_vllm_dir) -> None:
    """Three request slots (two sessions at once) for five rows, and a cache of about 350 ids
    for rows of ~100: sessions are closed and started again, texts do not change."""
    small = make_lm(
        tiny_bpe_vllm_dir,
        tiny_sp_vllm_dir,
        engine="vllm",
        enforce_eager=True,
        kv_cache_memory_bytes=6 << 20,
        max_num_seqs=3,
    )
    assert small.members[0].engine.sessions.capacity == 2
    requests = [gen_request(" ".join([p] * 6), until=["\n\n"], max_gen_toks=24) for p in random_prompts(5, seed=41)]
    (texts, _), (whole_texts, _) = both_ways(small, requests, schedule="safe", aggregator="gac", batch_size=5)
    assert texts == whole_texts


def test_private_names_are_reached_in_one_module() -> None:
    """Sessions and their rows reach no private vLLM name the adapter lists and import nothing
    from vLLM: a new vLLM release is checked against the adapter alone."""
    from pathlib import Path

    from lm_eval_safe.engines.vllm import vllm_internals

    names = vllm_internals.PRIVATE_NAMES
    assert len(names) >= 40
    attributes = {a for name in names for a in re.findall(r"\.(\w+)", name.split(":")[-1])}
    folder = Path(vllm_internals.__file__).parent
    for module in ("sessions.py", "session_rows.py"):
        source = (folder / module).read_text()
        assert not re.search(r"^\s*(from|import) vllm\b", source, re.MULTILINE), module
        assert [a for a in sorted(attributes) if re.search(rf"\.{a}\b", source)] == [], module


def test_an_untested_vllm_version_resubmits(lm, monkeypatch, caplog) -> None:
    """On a vLLM release outside the tested ones each engine says so in one log line and its
    rows re-submit whole sequences; texts and decoding statistics are those with sessions."""
    from lm_eval_safe.engines.vllm import vllm_internals
    from lm_eval_safe.engines.vllm.engine import VLLMEngine

    requests = [gen_request(p, until=["\n\n"], max_gen_toks=16) for p in random_prompts(3, seed=13)]
    texts, stats = decode(lm, requests, schedule="safe", aggregator="unite", batch_size=3)
    assert vllm_internals.unsupported(lm.members[0].engine.llm) is None
    monkeypatch.setattr(vllm_internals, "installed_version", lambda: "0.33.0")
    caplog.set_level(logging.INFO, logger="lm_eval_safe")
    engines = [member.engine for member in lm.members]
    gated = [VLLMEngine(engine.llm, engine.top, engine.settings) for engine in engines]
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("lm_eval_safe")]
    why = "vLLM 0.33.0 is not a version its private objects were tested on (0.32.0)"
    assert lines == [f"vLLM rows re-submit whole sequences each call: {why}"] * len(engines)
    assert all(engine.sessions is None for engine in gated)
    try:
        for member, engine in zip(lm.members, gated, strict=True):
            member.engine = engine
            engine.bind(member)
        gated_texts, gated_stats = decode(lm, requests, schedule="safe", aggregator="unite", batch_size=3)
    finally:
        for member, engine in zip(lm.members, engines, strict=True):
            member.engine = engine
    assert gated_texts == texts
    for key in ("generated_tokens", "ensemble_ops", "cycles", "drafted_tokens"):
        assert gated_stats[key] == stats[key], key
    assert gated_stats["submitted_tokens_per_token"] > stats["submitted_tokens_per_token"]
