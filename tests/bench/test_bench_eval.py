"""``lm-eval-safe bench eval``'s floor: the drafter's own run plus each verifier alone reading the
ensemble's texts.

Why: the floor is the figure that says what SAFE adds over what a second model costs anyway, so
it must read exactly the texts the ensemble answered (not the drafter's), on every verifier, and
its arithmetic must pick the fastest drafter run only where that run wrote the same answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lm_eval_safe.bench.eval_report import markdown
from lm_eval_safe.bench.eval_runs import (
    VERIFIER_READS,
    Rounds,
    floor,
    least_reads,
    read_answers,
    record_answers,
)
from tests.helpers import gen_request, make_lm


def _samples(texts: list[str]) -> dict[str, Any]:
    """``simple_evaluate``'s logged samples, one task, a response per document."""
    return {"samples": {"t": [{"doc_id": i, "resps": [[text]]} for i, text in enumerate(texts)]}}


def _rounds(own_texts: list[str], own_seconds: float) -> Rounds:
    rounds = Rounds(
        {"hf": [own_seconds], "alone": [10.0, 12.0, 11.0], "ensemble": [30.0], VERIFIER_READS: [6.0, 8.0]}
    )
    rounds.outputs = {"hf": _samples(own_texts), "alone": _samples(["a", "b"])}
    rounds.stats = {"alone": {"generated_tokens": 100}, "ensemble": {"generated_tokens": 120}}
    rounds.reads = {"v": {"8": 8.0, "1": 6.0}}
    return rounds


def test_the_floor_is_the_fastest_equal_drafter_run_per_token_times_the_ensembles_tokens_plus_the_reads() -> None:
    # lm-eval's backend wrote the same answers and ran faster: it is the drafter's run
    got = floor(_rounds(["a", "b"], 5.0), "hf")
    assert got is not None
    assert got["drafter_run"] == "hf"
    assert got["drafter_seconds"] == pytest.approx(5.0 / 100 * 120)
    assert got["verifier_reads_seconds"] == pytest.approx(7.0)
    assert got["floor_seconds"] == pytest.approx(6.0 + 7.0)
    assert got["ensemble_over_floor"] == pytest.approx(30.0 / 13.0)
    # different answers: its time is not the same work, so safe-ensemble's alone (median 11) counts
    got = floor(_rounds(["a", "c"], 5.0), "hf")
    assert got["drafter_run"] == "alone"
    assert got["floor_seconds"] == pytest.approx(11.0 / 100 * 120 + 7.0)
    # slower: the fastest run is the floor
    assert floor(_rounds(["a", "b"], 20.0), "hf")["drafter_run"] == "alone"
    # no reads (skipped): no floor
    rounds = _rounds(["a", "b"], 5.0)
    del rounds.runs[VERIFIER_READS]
    assert floor(rounds, "hf") is None


def test_the_report_states_the_ensemble_over_its_floor() -> None:
    report = {
        "command": "bench eval",
        "machine": "m",
        "tasks": ["t"],
        "limit": 2,
        "batch_size": 8,
        "max_gen_toks": 16,
        "members": ["d", "v"],
        "ensemble_args": "",
        "wall_seconds": {"alone": [10.0], "ensemble": [30.0], VERIFIER_READS: [7.0]},
        "floor": floor(_rounds(["a", "b"], 5.0), "hf"),
    }
    labels = {"hf": "lm-eval hf", "alone": "alone", "ensemble": "ensemble", VERIFIER_READS: "reads"}
    text = markdown(report, labels, "alone")
    assert "| reads | 7.0 |" in text
    assert "the ensemble takes **2.31x** its floor" in text
    assert "(lm-eval hf) 50.0 ms per token x the ensemble's 120 tokens = 6.0 s" in text
    assert "(the lesser of v 8.0 s at batch 8, 6.0 s at batch 1)" in text


def test_each_verifier_reads_exactly_the_texts_the_ensemble_answered(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    ensemble = make_lm(tiny_bpe_dir, tiny_sp_dir, batch_size=2)
    verifier = make_lm(tiny_sp_dir, batch_size=2)
    answers: list[tuple[str, str]] = []
    record_answers(ensemble, answers)
    contexts = ["the cat sat on", "a dog ran to the"]
    texts = ensemble.generate_until([gen_request(c, until=["\n\n"], max_gen_toks=6) for c in contexts])
    assert answers == list(zip(contexts, texts, strict=True))
    asked: list[tuple[str, str]] = []
    score = verifier.loglikelihood

    def loglikelihood(requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        asked.extend(tuple(r.args) for r in requests)
        return score(requests, disable_tqdm)

    verifier.loglikelihood = loglikelihood
    seconds = read_answers([verifier], answers)
    assert list(seconds) == [verifier.members[0].name] and list(seconds[verifier.members[0].name]) == ["2", "1"]
    assert least_reads(seconds) == min(seconds[verifier.members[0].name].values()) > 0
    assert asked == answers + answers  # every answer, at each batch size
    assert verifier.options.batch_size == 2  # as loaded again
    # a later call's answers replace the earlier ones
    ensemble.generate_until([gen_request(contexts[0], until=["\n\n"], max_gen_toks=3)])
    assert [c for c, _ in answers] == contexts[:1]
