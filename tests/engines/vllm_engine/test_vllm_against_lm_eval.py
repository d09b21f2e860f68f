"""The real members on vLLM: one member alone against lm-eval's own ``--model vllm`` on the same
checkpoint and arguments, and the default ensemble against itself on transformers.

Why: a leaderboard's member-alone rows come from lm-eval's ``vllm`` backend or from
``safe-ensemble`` with one member, and they must be the same numbers; and the ensemble on vLLM
must decide as on transformers. Needs ../shared and vLLM (CI's vLLM environment).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import gen_request

pytestmark = [pytest.mark.real, pytest.mark.vllm, pytest.mark.usefixtures("vllm_installed")]

ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}


@pytest.fixture(scope="module")
def gemma_alone(models: Path):
    from lm_eval_safe.harness.model import SafeEnsembleLM

    return SafeEnsembleLM(members="gemma3-270m", engine="vllm", batch_size="auto", **ENGINE)


@pytest.fixture(scope="module")
def lm_eval_vllm(gemma_alone):
    """lm-eval's own vllm backend on the folder the member was loaded from, same arguments."""
    from lm_eval_safe.bench.vllm_parity import lm_eval_vllm_for

    return lm_eval_vllm_for(gemma_alone.members[0])


def test_one_member_on_vllm_equals_lm_eval_vllm(gemma_alone, lm_eval_vllm, shared_dir: Path) -> None:
    """8 GSM8K and 8 BBH (3-shot) greedy requests through lm-eval's own pipeline: identical
    responses; 17 log-likelihoods within 1e-4 and the same is_greedy flags."""
    from lm_eval_safe.bench.vllm_parity import compare_with_lm_eval_vllm

    report = compare_with_lm_eval_vllm(gemma_alone, lm_eval_vllm, shared_dir / "data")
    assert report["responses"] == 16 and report["different_responses"] == []
    assert report["largest_loglikelihood_gap"] < 1e-4 and report["is_greedy_differs"] == 0


def test_default_ensemble_on_vllm_decides_as_on_transformers(models: Path, shared_dir: Path) -> None:
    """The README's members on both engines, two GSM8K questions in the chat template: the same
    texts and the same decisions (where a near-tie could flip, the engines' log-probs would
    differ by more than the 1e-4 the single-member test allows)."""
    import json

    from lm_eval_safe.harness.model import SafeEnsembleLM
    from lm_eval_safe.members.member import CHAT_MARKER

    rows = [json.loads(x) for x in (shared_dir / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()[:2]]
    requests = [
        gen_request(
            CHAT_MARKER + json.dumps({"messages": [{"role": "user", "content": r["question"]}], "add_generation_prompt": True}),
            until=["Question:"],
            max_gen_toks=64,
        )
        for r in rows
    ]
    results = {}
    for engine in ("hf", "vllm"):
        lm = SafeEnsembleLM(members="smollm2-135m,gemma3-270m", engine=engine, batch_size=2, **(ENGINE if engine == "vllm" else {}))
        results[engine] = (lm.generate_until(requests, disable_tqdm=True), lm.run_stats.summary())
    assert results["vllm"][0] == results["hf"][0]
    for key in ("ensemble_ops", "ensemble_replaced", "consensus_skips", "cycles"):
        assert results["vllm"][1][key] == results["hf"][1][key], key
    assert results["vllm"][1]["certified_decisions"] > 10 * max(1, results["vllm"][1]["full_decisions"])


def test_one_member_past_a_64_token_window_equals_lm_eval_vllm(models: Path, shared_dir: Path) -> None:
    """SmolLM2 on vLLM with max_length=64: loglikelihood with 80-token contexts (one choice of a
    single token: greedy flags too) and rolling over 70- and 200-token texts, left-truncated as
    lm-eval's vllm truncates them (``max_length - 1``, windows of ``max_length - 2``; vLLM
    refused a 64-token prompt before), within 1e-4 of lm-eval's own ``--model vllm``."""
    import json

    from lm_eval.api.instance import Instance

    from lm_eval_safe.bench.vllm_parity import lm_eval_vllm_for
    from lm_eval_safe.harness.model import SafeEnsembleLM

    # a 64-token window needs a small KV cache (engines live as long as the process)
    ours = SafeEnsembleLM(members="smollm2-135m", engine="vllm", max_length=64, batch_size="auto", **{**ENGINE, "kv_cache_memory_bytes": 64 << 20})
    theirs = lm_eval_vllm_for(ours.members[0])
    tokenizer = ours.members[0].tokenizer
    rows = [json.loads(x) for x in (shared_dir / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()[:6]]
    ids = tokenizer.encode(" ".join(r["question"] + " " + r["answer"] for r in rows))

    def text(start: int, n: int) -> str:
        cut = tokenizer.decode(ids[start : start + n])
        assert len(tokenizer.encode(cut)) == n
        return cut

    loglikelihood = [
        Instance("loglikelihood", {}, (text(0, 80), " " + text(300, 6).strip()), 0),
        Instance("loglikelihood", {}, (text(100, 80), text(400, 12)), 0),
        Instance("loglikelihood", {}, (text(200, 62), text(500, 1)), 0),
    ]
    rolling = [Instance("loglikelihood_rolling", {}, (text(50, 70),), 0), Instance("loglikelihood_rolling", {}, (text(500, 200),), 0)]
    for (a, greedy_a), (b, greedy_b) in zip(*(lm.loglikelihood(loglikelihood, disable_tqdm=True) for lm in (ours, theirs)), strict=True):
        assert abs(a - b) < 1e-4 and greedy_a == greedy_b
    for a, b in zip(*(lm.loglikelihood_rolling(rolling, disable_tqdm=True) for lm in (ours, theirs)), strict=True):
        assert abs(a - b) < 1e-4
