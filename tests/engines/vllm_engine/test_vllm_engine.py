"""Members on vLLM (``engine=vllm``) against the same members on transformers.

Why: the vLLM engine answers the decoder's calls with heads (top-K log-probs) and re-submitted
sequences instead of full rows from a KV cache it owns. Each layer is checked against the
transformers engine, which computes the same model in float32 by another code path: the rows
of every call type, the texts and decisions of every schedule, the certified decisions against
the full distributions, scores, sampling, traces, and the one-line errors a user can meet.
Tiny random models with a head size vLLM's CPU kernels accept (32) keep it to seconds per call.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from helpers import SCHEDULES, as_full, gen_request, ll_request, make_lm, random_prompts

from lm_eval_safe.errors import OptionError
from lm_eval_safe.options import SafeOptions

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_installed")]

ENFORCE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}  # no CPU compile step (minutes per engine); a small cache: engines live as long as the process


def with_options(lm, **changes):
    """The same loaded members decoded with other options (a new decoder; nothing reloads)."""
    from lm_eval_safe.decoder.loop import SafeDecoder
    from lm_eval_safe.decoder.stats import GenerationStats

    lm.options = dataclasses.replace(lm.options, **changes)
    lm.decoder = SafeDecoder(lm.members, lm.drafter_index, lm.options)
    lm.run_stats = GenerationStats()
    if "seed" in changes:  # sampled requests' streams are seeded when jobs are built
        lm.jobs.sampling_seed = changes["seed"]
    return lm


@pytest.fixture(scope="module")
def pair(tiny_bpe_vllm_dir: Path, tiny_sp_vllm_dir: Path):
    """(transformers, vLLM) ensembles of the same two tiny members."""
    hf = make_lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir)
    vllm = make_lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir, engine="vllm", **ENFORCE)
    return hf, vllm


def _close(a: float, b: float, tol: float = 1e-4) -> bool:
    return abs(a - b) <= tol


def _assert_head_matches(head, full: torch.Tensor) -> None:
    """A vLLM head against the transformers engine's full row: every known log-prob equal to
    float tolerance, and its ids the full row's most probable ones (up to near-ties)."""
    for token, lp in head.known.items():
        assert _close(lp, float(full[token])), (token, lp, float(full[token]))
    kth = head.logprobs[-1]
    stronger = {int(i) for i in torch.nonzero(full > kth + 1e-4).flatten()}
    assert stronger <= set(head.ids), (stronger - set(head.ids))


def test_every_call_answers_as_the_transformers_engine(pair) -> None:
    """Draft, Forward (inner and next-token positions) and Complete on two rows of a batch."""
    from lm_eval_safe.engines.base import Complete, Draft, Forward

    hf_lm, vllm_lm = pair
    member_hf, member_vllm = hf_lm.members[0], vllm_lm.members[0]
    prompts = [member_hf.encode(p) for p in random_prompts(2, seed=11)]
    batches = [member_hf.engine.new_batch(), member_vllm.engine.new_batch()]
    for batch in batches:
        batch.add_row()
        batch.add_row()
    drafts = {r: Draft(0, 0, prompts[r], 6, member_hf.eos_ids) for r in range(2)}
    hf_drafts, vllm_drafts = (b.run(drafts) for b in batches)
    for r in range(2):
        assert vllm_drafts[r].tokens == hf_drafts[r].tokens
        for head, full in zip(vllm_drafts[r].rows, hf_drafts[r].rows, strict=True):
            _assert_head_matches(head, as_full(full))
    # a verifier-style forward over the drafted text: keep the prompt, feed the tokens, rows at
    # an inner position and after the last one
    forwards = {
        r: Forward(0, len(prompts[r]), hf_drafts[r].tokens, [1, len(hf_drafts[r].tokens) - 1])
        for r in range(2)
    }
    hf_rows, vllm_rows = (b.run(forwards) for b in batches)
    for r in range(2):
        for head, full in zip(vllm_rows[r], hf_rows[r], strict=True):
            _assert_head_matches(head, as_full(full))
    (completed,) = batches[1].run({0: Complete(0, [vllm_rows[0][0]])})[0]
    assert torch.allclose(completed, as_full(hf_rows[0][0]), atol=1e-4)


@pytest.mark.parametrize(("schedule", "aggregator"), SCHEDULES)
def test_every_schedule_gives_the_transformers_texts(pair, schedule: str, aggregator: str) -> None:
    """Same members, same options, batch 3: the texts and every decision count are those of the
    transformers engine (tiny float32 models: the engines' rounding differs by ~1e-6, far
    from the margins these prompts decide on)."""
    requests = [gen_request(p, until=["\n\n"], max_gen_toks=24) for p in random_prompts(5, seed=7)]
    out = {}
    for lm in pair:
        with_options(lm, schedule=schedule, aggregator=aggregator, batch_size=3)
        out[lm.members[0].engine.kind] = (lm.generate_until(requests, disable_tqdm=True), lm.run_stats.summary())
    assert out["vllm"][0] == out["hf"][0]
    keys = ["generated_tokens", "ensemble_ops", "ensemble_replaced", "aligned_positions", "consensus_skips"]
    if schedule != "drafter":  # alone, vLLM drafts a whole budget per call, stopping at stop strings
        keys += ["cycles", "drafted_tokens"]
    for key in keys:
        assert out["vllm"][1][key] == out["hf"][1][key], key
    stats = out["vllm"][1]
    assert stats["engine_calls_per_token"] > 0
    # the host's share: the wall time outside the engine calls, per generated token (the run's
    # own clocks, rounded to the millisecond in the summary)
    host = 1000 * (stats["wall_seconds"] - stats["engine_seconds"]) / stats["generated_tokens"]
    assert 0 < stats["host_ms_per_token"] == pytest.approx(host, abs=2.0 / stats["generated_tokens"] + 1e-3)
    if schedule != "drafter":
        # both engines answer with heads (transformers: cut on the device from its full rows)
        assert stats["certified_decisions"] + stats["full_decisions"] > 0
        hf_stats = out["hf"][1]
        assert hf_stats["certified_decisions"] + hf_stats["full_decisions"] > 0


def test_certified_decisions_equal_full_vocabulary_decisions(pair, monkeypatch) -> None:
    """Every decision the vLLM ensemble took from heads, taken again by the exact aggregator on
    the full distributions of the same positions (fetched from vLLM afterwards)."""
    from lm_eval_safe.engines.base import Complete
    from lm_eval_safe.ensemble import aggregators
    from lm_eval_safe.ensemble.aggregate import View, gac, unite

    _, lm = pair
    seen = []
    for aggregator, certify in (("gac", "certified_gac"), ("unite", "certified_unite")):
        original = getattr(aggregators, certify)

        def spy(views, *args, _original=original, _aggregator=aggregator):
            choice = _original(views, *args)
            if choice is not None:
                seen.append((_aggregator, views, args, choice))
            return choice

        monkeypatch.setattr(aggregators, certify, spy)
        # every token an ensemble point: many decisions per request
        with_options(lm, aggregator=aggregator, schedule="every", batch_size=2)
        lm.generate_until([gen_request(p, until=[], max_gen_toks=16) for p in random_prompts(3, seed=21)], disable_tqdm=True)
    assert sum(a == "gac" for a, *_ in seen) > 10 and sum(a == "unite" for a, *_ in seen) > 10
    batches = [m.engine.new_batch() for m in lm.members]
    for aggregator, views, args, choice in seen:
        full = []
        for slot, view in enumerate(views):
            (row,) = batches[slot].run({0: Complete(slot, [view.logprobs])})[0]
            full.append(View(row, view.vocab, view.tokenizer, view.weight))
        exact = gac(full, *args) if aggregator == "gac" else unite(full, *args)
        assert (exact.key, exact.sharpened) == (choice.key, choice.sharpened)


@pytest.mark.parametrize("weights", [[1.0, 0.0], [0.0, 1.0]])
@pytest.mark.parametrize("aggregator", ["unite", "gac"])
def test_a_zero_weight_gives_the_transformers_texts(pair, weights: list[float], aggregator: str) -> None:
    """``weights`` with a 0 and ``sharpen=geometric``, every token an ensemble point: the member
    of weight 0 takes no part on either engine, whether a decision is taken from heads or on
    full distributions, so both write the same texts."""
    requests = [gen_request(p, until=[], max_gen_toks=20) for p in random_prompts(4, seed=37)]
    texts = []
    try:
        for lm in pair:
            with_options(lm, schedule="every", aggregator=aggregator, sharpen="geometric", weights=weights, batch_size=2)
            texts.append(lm.generate_until(requests, disable_tqdm=True))
            assert lm.run_stats.ensemble_ops > 0
    finally:  # the other tests of the module share these members and set neither option
        for lm in pair:
            with_options(lm, weights=None, sharpen=SafeOptions.sharpen)
    assert texts[0] == texts[1]


def test_three_members_with_a_sliding_window_gemma(tiny_bpe_vllm_dir, tiny_sp_vllm_dir, tiny_gemma_vllm_dir) -> None:
    members = (tiny_sp_vllm_dir, tiny_bpe_vllm_dir, tiny_gemma_vllm_dir)
    requests = [gen_request(p, until=[], max_gen_toks=20) for p in random_prompts(4, seed=5)]
    texts = {}
    for engine in ("hf", "vllm"):
        lm = make_lm(*members, engine=engine, batch_size=2, **(ENFORCE if engine == "vllm" else {}))
        texts[engine] = lm.generate_until(requests, disable_tqdm=True)
        assert lm.run_stats.ensemble_ops > 0
    assert texts["vllm"] == texts["hf"]


def test_loglikelihood_and_rolling_equal_transformers(pair) -> None:
    from lm_eval.api.instance import Instance

    prompts = random_prompts(6, seed=13)
    requests = [ll_request(p, " the cat sat") for p in prompts] + [ll_request(p[:9], p[9:]) for p in prompts]
    rolling = [Instance("loglikelihood_rolling", {}, (p,), 0) for p in prompts]
    hf, vllm = (with_options(lm, batch_size=4) for lm in pair)
    for (a, greedy_a), (b, greedy_b) in zip(hf.loglikelihood(requests, disable_tqdm=True), vllm.loglikelihood(requests, disable_tqdm=True), strict=True):
        assert _close(a, b, 1e-3) and greedy_a == greedy_b
    for a, b in zip(hf.loglikelihood_rolling(rolling, disable_tqdm=True), vllm.loglikelihood_rolling(rolling, disable_tqdm=True), strict=True):
        assert _close(a, b, 1e-3)


def test_one_member_scores_equal_transformers(tiny_bpe_vllm_dir) -> None:
    """One member alone: lm-eval's own loglikelihood rule (per-token sum, all-argmax flag)."""
    requests = [ll_request(p, " over 3 hills") for p in random_prompts(5, seed=17)]
    hf = make_lm(tiny_bpe_vllm_dir)
    vllm = make_lm(tiny_bpe_vllm_dir, engine="vllm", **ENFORCE)
    for (a, ga), (b, gb) in zip(hf.loglikelihood(requests, disable_tqdm=True), vllm.loglikelihood(requests, disable_tqdm=True), strict=True):
        assert _close(a, b, 1e-3) and ga == gb


def test_sampling_is_reproducible_and_reads_full_distributions(pair) -> None:
    _, lm = pair
    requests = [gen_request(p, until=[], max_gen_toks=16, do_sample=True, temperature=0.8, top_p=0.9) for p in random_prompts(3, seed=23)]
    first = with_options(lm, schedule="safe", aggregator="gac", batch_size=2, seed=3).generate_until(requests, disable_tqdm=True)
    stats = lm.run_stats.summary()
    again = with_options(lm, seed=3).generate_until(requests, disable_tqdm=True)
    other = with_options(lm, seed=4).generate_until(requests, disable_tqdm=True)
    assert first == again and first != other
    assert stats["sampled_requests"] == 3
    assert stats["ensemble_ops"] > 0 and stats["full_decisions"] == stats["ensemble_ops"]


def test_trace_changes_no_text(pair, tmp_path: Path) -> None:
    _, lm = pair
    requests = [gen_request(p, until=[], max_gen_toks=20) for p in random_prompts(3, seed=29)]
    plain = with_options(lm, trace=False).generate_until(requests, disable_tqdm=True)
    records = []
    lm.decoder.generate_many(
        [(p.args[0], [], 20) for p in requests], 1, on_trace=lambda i, r: records.append(r)
    )
    assert sorted(r["text"] for r in records) == sorted(plain)
    assert any(r["points"] for r in records)
    assert all(len(p["ensemble"]) > 0 for r in records for p in r["points"])


def test_use_cache_keeps_vllm_answers_apart(pair) -> None:
    hf, vllm = pair
    assert hf.cache_namespace != vllm.cache_namespace
    assert "engine" not in hf.members[0].identity()


# -- one line for what a user can fix ----------------------------------------------------------
def test_unknown_vllm_argument(tiny_bpe_vllm_dir, tiny_sp_vllm_dir) -> None:
    with pytest.raises(OptionError, match="^unknown model_args key 'gpu_memory_utilisation': neither a safe-ensemble option nor an argument of vLLM"):
        make_lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir, engine="vllm", gpu_memory_utilisation=0.5)


def test_per_member_values_must_match_the_vllm_members(tiny_bpe_vllm_dir, tiny_sp_vllm_dir) -> None:
    with pytest.raises(OptionError, match=r"^enforce_eager='true\|true\|true' has 3 values for 2 vLLM members"):
        make_lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir, engine="vllm", enforce_eager="true|true|true")


def test_kv_cache_too_small_names_the_setting(tiny_bpe_vllm_dir) -> None:
    with pytest.raises(OptionError, match="kv_cache_memory_bytes="):
        make_lm(tiny_bpe_vllm_dir, engine="vllm", **{**ENFORCE, "kv_cache_memory_bytes": 4096})


def test_model_vllm_cannot_run_names_the_member(tiny_bpe_dir, tiny_sp_vllm_dir) -> None:
    """The standard tiny Llama has head size 16, which vLLM's CPU attention refuses."""
    with pytest.raises(OptionError, match=rf"^member '{tiny_bpe_dir}': vLLM cannot run this model .*engines=vllm,hf"):
        make_lm(tiny_bpe_dir, tiny_sp_vllm_dir, engine="vllm", **ENFORCE)


def test_mixed_engines(tiny_bpe_vllm_dir, tiny_sp_vllm_dir, pair) -> None:
    """``engines=hf,vllm``: the drafter on transformers, the verifier on vLLM."""
    requests = [gen_request(p, until=[], max_gen_toks=20) for p in random_prompts(3, seed=31)]
    mixed = make_lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir, engines="hf,vllm", **ENFORCE)
    assert [m.engine.kind for m in mixed.members] == ["hf", "vllm"]
    hf = with_options(pair[0], schedule="safe", aggregator="unite", batch_size=1)
    assert mixed.generate_until(requests, disable_tqdm=True) == hf.generate_until(requests, disable_tqdm=True)
    assert math.isfinite(mixed.run_stats.summary()["host_ms_per_token"])


def test_data_parallel_through_lm_evals_launcher(tmp_path: Path, tiny_bpe_vllm_dir, tiny_sp_vllm_dir) -> None:
    """Two torchrun processes, each with its own vLLM engines, give the responses of one."""
    import sys

    from helpers import run_gsm8k_cli, torchrun, write_apples_gsm8k

    data = write_apples_gsm8k(tmp_path / "data")
    args = f"members={tiny_bpe_vllm_dir},{tiny_sp_vllm_dir},engine=vllm,enforce_eager=true,kv_cache_memory_bytes={256 << 20}"
    single = run_gsm8k_cli([sys.executable], args, data, tmp_path / "one", timeout=900)
    double = run_gsm8k_cli(torchrun(2), args, data, tmp_path / "two", timeout=900)
    assert sorted(double["resps"]) == list(range(5)) and double["resps"] == single["resps"]
    assert double["results"]["config"]["world_size"] == 2


def test_reference_authors_gives_the_transformers_texts(pair) -> None:
    """``reference=authors`` on vLLM members (which answer with heads: the mode asks for full
    distributions at every aligned position) writes the transformers engine's texts, ensemble
    points and counts, in batches of two."""
    requests = [gen_request(p, until=[], max_gen_toks=20) for p in random_prompts(4, seed=41)]
    out = []
    try:
        for lm in pair:
            with_options(lm, reference="authors", schedule="safe", aggregator="unite", sharpen="heuristic", batch_size=2)
            texts = lm.generate_until(requests, disable_tqdm=True)
            summary = lm.run_stats.summary()
            out.append((texts, summary["ensemble_ops"], summary["aligned_positions"], summary["consensus_skips"]))
    finally:  # the other tests of the module share these members
        for lm in pair:
            with_options(lm, reference=SafeOptions.reference)
    assert out[0] == out[1]
    assert out[0][1] > 0
