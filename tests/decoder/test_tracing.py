"""trace=true: every ensemble point of every response, keyed to join lm-eval's samples, and the
texts unchanged by tracing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import evaluate_gsm8k, make_lm, random_prompts, write_gsm8k
from lm_eval.api.instance import Instance

from lm_eval_safe.decoder import tracing
from lm_eval_safe.errors import OptionError


def _request(context: str, doc_id: int, **gen_kwargs: object) -> Instance:
    return Instance(
        request_type="generate_until",
        doc={},
        arguments=(context, {"until": ["\n\n"], "max_gen_toks": 24, **gen_kwargs}),
        idx=0,
        metadata=("tiny_task", doc_id, 1),
    )


def _lines(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("traces_*.jsonl")) for line in f.open()]


@pytest.mark.parametrize("schedule,aggregator", [("safe", "unite"), ("aligned", "gac"), ("every", "unite")])
def test_every_ensemble_point_is_traced_once_and_texts_do_not_change(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path: Path, schedule: str, aggregator: str
) -> None:
    prompts = random_prompts(6, seed=3)
    options = {"schedule": schedule, "aggregator": aggregator, "batch_size": 2}
    plain = make_lm(tiny_bpe_dir, tiny_sp_dir, **options)
    traced = make_lm(tiny_bpe_dir, tiny_sp_dir, trace=True, trace_dir=str(tmp_path), **options)
    requests = [_request(p, doc_id=i) for i, p in enumerate(prompts)]
    texts = plain.generate_until(requests)
    assert traced.generate_until(requests) == texts
    lines = _lines(tmp_path)
    assert sorted(line["doc_id"] for line in lines) == list(range(len(prompts)))
    assert {line["task"] for line in lines} == {"tiny_task"}
    assert sum(len(line["points"]) for line in lines) == traced.run_stats.ensemble_ops
    assert traced.run_stats.ensemble_ops == plain.run_stats.ensemble_ops > 0
    replaced = 0
    for line in lines:
        text = texts[line["doc_id"]]
        assert line["text"] == text and line["repeat"] == 0
        assert line["counts"]["ensemble_ops"] == len(line["points"])
        for index, point in enumerate(line["points"]):
            assert point["index"] == index
            assert set(point["members"]) == {m.name for m in traced.members}
            for candidates in [point["ensemble"], *point["members"].values()]:
                probs = [p for _, p in candidates]
                assert probs == sorted(probs, reverse=True) and sum(probs) <= 1.0 + 1e-6
            replaced += point["action"] == "replaced"
            if point["action"] == "kept":
                assert point["chosen"] == point["drafted"]
            written = point["written"]
            end = point["offset"] + len(written)
            if point["chosen"] != "<eos>" and "\ufffd" not in written and end <= len(text):
                # the response, as the drafter decodes it, holds what was written at the offset
                assert text[point["offset"] : end] == written
    assert replaced == traced.run_stats.ensemble_replaced


def test_sampled_repeats_are_numbered_and_carry_the_acceptance_test(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path: Path
) -> None:
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, trace=True, trace_dir=str(tmp_path), seed=7)
    request = _request("the cat sat on", doc_id=4, do_sample=True, temperature=1.0)
    lm.generate_until([request, request, request])
    lines = _lines(tmp_path)
    assert [(line["doc_id"], line["repeat"]) for line in lines] == [(4, 0), (4, 1), (4, 2)]
    points = [p for line in lines for p in line["points"]]
    assert points and all(line["sampled"] for line in lines)
    for point in points:
        test = point["acceptance"]
        assert 0.0 <= test["draw"] < 1.0 and 0.0 <= test["keep_probability"] <= 1.0
        if point["action"] == "replaced":  # speculative sampling replaces only above the bar
            assert test["draw"] >= test["keep_probability"]


def test_traces_pair_with_lm_eval_samples(tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path: Path) -> None:
    """Through lm-eval with an EvaluationTracker (what --output_path --log_samples build): the
    trace file lands beside samples_<task>_<date>.jsonl, with the same date, one line per sample."""
    from lm_eval.loggers import EvaluationTracker

    data = write_gsm8k(tmp_path / "d", [{"question": f"What is {i} plus 3?", "answer": f"#### {i + 3}"} for i in range(3)])
    tracker = EvaluationTracker(output_path=str(tmp_path / "out"))
    results = evaluate_gsm8k(
        data,
        f"members={tiny_bpe_dir},{tiny_sp_dir},trace=true,max_gen_toks=16",
        log_samples=True,
        evaluation_tracker=tracker,
        gen_kwargs="max_gen_toks=16",
    )
    tracker.save_results_aggregated(results=results, samples=results["samples"])
    tracker.save_results_samples(task_name="safe_gsm8k", samples=results["samples"]["safe_gsm8k"])
    samples_files = list((tmp_path / "out").rglob("samples_safe_gsm8k_*.jsonl"))
    assert len(samples_files) == 1
    samples_file = samples_files[0]
    traces_file = samples_file.with_name(samples_file.name.replace("samples_", "traces_", 1))
    assert traces_file.is_file(), sorted(p.name for p in samples_file.parent.iterdir())
    samples = {s["doc_id"]: s for s in map(json.loads, samples_file.open())}
    traces = [json.loads(line) for line in traces_file.open()]
    assert sorted(t["doc_id"] for t in traces) == sorted(samples) == [0, 1, 2]
    for trace in traces:
        assert trace["text"] == samples[trace["doc_id"]]["resps"][0][trace["repeat"]]
    stats = results["config"]["safe_stats"]
    assert sum(len(t["points"]) for t in traces) == stats["ensemble_ops"]


def test_trace_needs_a_folder(tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_tracker", None)
    with pytest.raises(OptionError, match="trace=true needs somewhere to write"):
        make_lm(tiny_bpe_dir, tiny_sp_dir, trace=True)
    with pytest.raises(OptionError, match="add trace=true"):
        make_lm(tiny_bpe_dir, tiny_sp_dir, trace_dir="x")


@pytest.mark.real
@pytest.mark.parametrize("engine", ["hf", pytest.param("llama_cpp", marks=pytest.mark.llama_cpp)])
def test_real_pair_on_bbh_traces_every_point_and_keeps_its_texts(
    engine: str,
    real_models_dir: Path,
    shared_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """The default members on a few BBH questions through lm-eval (decoded together), traced
    and not, on each engine: the same responses, and every ensemble point that safe_stats counts
    is in the traces once."""
    if engine == "llama_cpp":
        request.getfixturevalue("llama_cpp_installed")
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    import lm_eval_safe

    monkeypatch.setenv("LM_EVAL_SAFE_MODELS", str(real_models_dir))
    manager = TaskManager(include_path=lm_eval_safe.task_dir(), metadata={"data_dir": str(shared_dir / "data")})
    outputs = {}
    for trace in (False, True):
        tracker = EvaluationTracker(output_path=str(tmp_path / f"trace-{trace}"))
        results = lm_eval.simple_evaluate(
            model="safe-ensemble",
            model_args=f"members=smollm2-135m,gemma3-270m,engine={engine},batch_size=3,trace={str(trace).lower()}",
            tasks=["safe_bbh_navigate"],
            task_manager=manager,
            limit=3,
            gen_kwargs="max_gen_toks=40",
            log_samples=True,
            evaluation_tracker=tracker,
            bootstrap_iters=0,
        )
        tracker.save_results_aggregated(results=results, samples=results["samples"])
        tracker.save_results_samples(task_name="safe_bbh_navigate", samples=results["samples"]["safe_bbh_navigate"])
        outputs[trace] = results
    texts = {
        trace: [s["resps"][0][0] for s in sorted(r["samples"]["safe_bbh_navigate"], key=lambda s: s["doc_id"])]
        for trace, r in outputs.items()
    }
    assert texts[True] == texts[False]
    stats = outputs[True]["config"]["safe_stats"]
    assert stats["ensemble_ops"] == outputs[False]["config"]["safe_stats"]["ensemble_ops"] > 0
    traces = _lines(next((tmp_path / "trace-True").rglob("samples_*.jsonl")).parent)
    assert sorted(t["doc_id"] for t in traces) == [0, 1, 2]
    assert sum(len(t["points"]) for t in traces) == stats["ensemble_ops"]
    assert sum(t["counts"]["consensus_skips"] for t in traces) == stats["consensus_skips"]
    for t in traces:
        assert t["text"] == texts[True][t["doc_id"]]
    # the report reads the run back, named by its engine beside the same run on transformers
    from lm_eval_safe.leaderboard.html_report import write_report
    from lm_eval_safe.leaderboard.runs import read_runs

    (run,) = read_runs([tmp_path / "trace-True"])
    assert run.config.endswith(" on llama_cpp") == (engine == "llama_cpp")
    assert run.traced and sorted(run.samples["safe_bbh_navigate"]) == [0, 1, 2]
    page = write_report([tmp_path / "trace-True"], tmp_path / "report.html").read_text()
    assert run.config in page
