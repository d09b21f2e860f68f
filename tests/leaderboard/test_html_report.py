"""``lm-eval-safe report``: lm-eval output folders of members alone (safe-ensemble and hf) and a
traced ensemble, read back, rendered, and checked in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import write_gsm8k

from lm_eval_safe.leaderboard.browser import HeadlessPage, find_chromium
from lm_eval_safe.leaderboard.html_report import build_report, write_report
from lm_eval_safe.leaderboard.runs import RunsError, read_runs

pytestmark = pytest.mark.slow  # whole processes and end-to-end runs: the slow tier

QUESTIONS = [{"question": f"What is {i} plus 3?", "answer": f"#### {i + 3}"} for i in range(4)]


def _evaluate(data: Path, out: Path, model: str, model_args: str, limit: int | None = None) -> Path:
    """One run as ``lm_eval --output_path out --log_samples`` writes it."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    import lm_eval_safe

    tracker = EvaluationTracker(output_path=str(out))
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["safe_gsm8k"],
        task_manager=TaskManager(include_path=lm_eval_safe.task_dir(), metadata={"data_dir": str(data)}),
        device="cpu",
        log_samples=True,
        evaluation_tracker=tracker,
        gen_kwargs="max_gen_toks=20",
        limit=limit,
    )
    tracker.save_results_aggregated(results=results, samples=results["samples"])
    tracker.save_results_samples(task_name="safe_gsm8k", samples=results["samples"]["safe_gsm8k"])
    return out


@pytest.fixture(scope="module")
def folders(tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report")
    data = write_gsm8k(root / "d", QUESTIONS)
    return {
        "bpe": _evaluate(data, root / "bpe", "safe-ensemble", f"members={tiny_bpe_dir}"),
        "sp": _evaluate(data, root / "sp", "hf", f"pretrained={tiny_sp_dir},dtype=float32"),
        "pair": _evaluate(
            data, root / "pair", "safe-ensemble", f"members={tiny_bpe_dir},{tiny_sp_dir},trace=true"
        ),
        "data": data,
    }


def _traces(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in folder.rglob("traces_*.jsonl") for line in path.open()]


def test_runs_are_read_back_as_lm_eval_wrote_them(folders: dict[str, Path]) -> None:
    runs = read_runs([folders["bpe"], folders["sp"], folders["pair"]])
    assert [r.is_single for r in runs] == [True, True, False]
    names = {r.config for r in runs}
    assert any("(hf)" in n for n in names), names  # an hf run is a member alone
    pair = runs[-1]
    assert pair.traced and set(pair.samples) == {"safe_gsm8k"}
    assert sorted(pair.samples["safe_gsm8k"]) == [0, 1, 2, 3]
    samples_file = next(folders["pair"].rglob("samples_safe_gsm8k_*.jsonl"))
    for row in map(json.loads, samples_file.open()):
        sample = pair.samples["safe_gsm8k"][row["doc_id"]]
        assert sample.responses == row["resps"][0]
        assert sample.correct == (row["exact_match"] >= 0.5)


def test_the_same_runs_on_another_engine_are_named_apart(folders: dict[str, Path], tmp_path: Path) -> None:
    """A run whose members name another engine (as a run with engine=llama_cpp writes them) is
    another configuration, not a second run of the first one."""
    other = tmp_path / "pair_llama_cpp"
    shutil.copytree(folders["pair"], other)
    for path in other.rglob("results_*.json"):
        results = json.loads(path.read_text())
        for member in results["config"]["members"]:
            member["engine"] = "llama_cpp"
        path.write_text(json.dumps(results))
    first, second = sorted(read_runs([folders["pair"], other]), key=lambda r: len(r.config))
    assert second.config == first.config + " on llama_cpp"
    assert " on " not in first.config


def test_report_in_a_real_browser(folders: dict[str, Path], tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:
        if os.environ.get("LM_EVAL_SAFE_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    page_path = tmp_path / "report.html"
    command = [sys.executable, "-m", "lm_eval_safe.cli", "report", str(folders["bpe"]), str(folders["sp"]),
               str(folders["pair"]), "--output", str(page_path)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    html = page_path.read_text()
    # self-contained: nothing is fetched (xmlns URIs of the inline SVG are names, not requests)
    assert not re.search(r"""(?:src|href|url)\s*[=(]\s*["']?(?:https?:)?//""", html)
    assert "<script src" not in html and "<link" not in html
    traces = {t["doc_id"]: t for t in _traces(folders["pair"])}
    doc, trace = next((d, t) for d, t in sorted(traces.items()) if t["points"])
    with HeadlessPage(binary) as page:
        page.open(page_path)
        rows = page.evaluate("[...document.querySelectorAll('#leaderboard tr.leaderboard-row')].map(r => r.dataset.config)")
        assert len(rows) == 3 and rows[2].startswith("unite-safe")
        grid = page.evaluate("[...document.querySelectorAll('#grid tr.question')].map(r => r.dataset.q)")
        assert grid == [f"safe_gsm8k-{i}" for i in range(len(QUESTIONS))]
        page.evaluate(f"document.querySelector('tr.question[data-q=\"safe_gsm8k-{doc}\"]').click()")
        view = f"#view-safe_gsm8k-{doc}"
        assert page.evaluate(f"document.querySelector('{view}').hidden") is False
        marks = page.evaluate(
            f"[...document.querySelectorAll('{view} span.point[data-point]')].map(s => [Number(s.dataset.point), s.classList.contains('replaced')])"
        )
        assert sorted(i for i, _ in marks) == list(range(len(trace["points"])))
        assert [r for _, r in sorted(marks)] == [p["action"] == "replaced" for p in trace["points"]]
        assert page.evaluate(f"document.querySelectorAll('{view} .response').length") == 3
        point = trace["points"][0]
        page.evaluate(f"document.querySelector('{view} span.point[data-point=\"0\"]').click()")
        shown = page.evaluate("document.getElementById('candidates').innerText")
        assert f"point 0 at character {point['offset']}" in shown
        assert json.dumps(point["chosen"], ensure_ascii=False) in shown and point["action"] in shown
        for member, candidates in point["members"].items():
            assert member in shown
            assert f"{candidates[0][1]:.3f}" in shown
        # the filters hide rows: "fixed" keeps only questions no member alone got right
        page.evaluate("document.querySelector('input[value=fixed]').click()")
        visible = page.evaluate("[...document.querySelectorAll('#grid tr.question')].filter(r => !r.hidden).length")
        runs = read_runs([folders["bpe"], folders["sp"], folders["pair"]])
        fixed = [
            d for d in range(len(QUESTIONS))
            if runs[2].samples["safe_gsm8k"][d].correct
            and not any(r.samples["safe_gsm8k"][d].correct for r in runs[:2])
        ]
        assert visible == len(fixed)
        page.screenshot(tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_grid_filters_name_fixed_and_broken_questions(folders: dict[str, Path]) -> None:
    """Hand-set verdicts: doc 0 every member wrong and the ensemble right (fixed), doc 1 a
    member right and the ensemble wrong (broken), doc 2 all right, doc 3 all wrong."""
    runs = read_runs([folders["bpe"], folders["sp"], folders["pair"]])
    verdicts = {0: (False, False, True), 1: (True, False, False), 2: (True, True, True), 3: (False, False, False)}
    for doc, values in verdicts.items():
        for run, value in zip(runs, values, strict=True):
            run.samples["safe_gsm8k"][doc].correct = value
    page = build_report(runs, [folders["pair"]])
    for doc, (fixed, broken) in {0: (1, 0), 1: (0, 1), 2: (0, 0), 3: (0, 0)}.items():
        assert f'data-q="safe_gsm8k-{doc}" data-fixed="{fixed}" data-broken="{broken}"' in page


def test_bad_folders_are_one_line_errors(folders: dict[str, Path], tmp_path: Path, tiny_bpe_dir: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RunsError, match="no lm-eval results"):
        read_runs([empty])
    no_samples = tmp_path / "no_samples"
    shutil.copytree(folders["bpe"], no_samples)
    for path in no_samples.rglob("samples_*.jsonl"):
        path.unlink()
    with pytest.raises(RunsError, match="--log_samples"):
        read_runs([no_samples])
    wrong_trace = tmp_path / "wrong_trace"
    shutil.copytree(folders["pair"], wrong_trace)
    trace_path = next(wrong_trace.rglob("traces_*.jsonl"))
    lines = [json.loads(line) for line in trace_path.open()]
    lines[0]["text"] += " and more"
    trace_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(RunsError, match="belongs to another run"):
        read_runs([wrong_trace])
    with pytest.raises(RunsError, match="both are"):
        read_runs([folders["bpe"], folders["bpe"]])
    other_limit = _evaluate(folders["data"], tmp_path / "limit2", "safe-ensemble", f"members={tiny_bpe_dir},max_gen_toks=20", limit=2)
    with pytest.raises(RunsError, match="limit"):
        read_runs([folders["pair"], other_limit])
    out = tmp_path / "r.html"
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval_safe.cli", "report", str(empty), "--output", str(out)],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode != 0 and not out.exists()
    assert proc.stderr.strip().count("\n") == 0 and "lm-eval-safe report:" in proc.stderr
    assert write_report([folders["pair"]], out).is_file()


# -- real configuration names -----------------------------------------------------------------
def _named_runs() -> list[Any]:
    """Runs of the default members under the names the report gives real runs (60-100
    characters for an ensemble), two tasks of 20 questions each, hand-set verdicts."""
    from lm_eval_safe.leaderboard.result_cache import Outcome
    from lm_eval_safe.leaderboard.runs import Run, Sample, _configuration

    def named(
        members: list[str], engine: str, schedule: str = "safe", aggregator: str = "unite", sharpen: str = "heuristic"
    ) -> tuple[str, bool]:
        options = {"schedule": schedule, "aggregator": aggregator, "sharpen": sharpen}
        config = {
            "model": "safe-ensemble",
            "members": [{"name": m, "engine": engine} for m in members],
            "safe_options": options,
            "drafter": members[0],
        }
        name, single, _ = _configuration(config, Path("."))
        return name, single

    default = ["smollm2-135m", "gemma3-270m"]
    configs = [
        named(["smollm2-135m"], "hf"), named(["gemma3-270m"], "hf"), named(["smollm2-135m"], "llama_cpp"),
        named(default, "hf", sharpen="geometric"), named(default, "llama_cpp"), named(default[::-1], "llama_cpp", "threshold", "gac"),
        named([*default, "qwen2.5-coder-0.5b"], "llama_cpp", "every"),
    ]  # fmt: skip
    runs = []
    for j, (name, single) in enumerate(configs):
        outcomes, samples = {}, {}
        for t, task in enumerate(("safe_gsm8k", "safe_bbh_navigate")):
            right = [(3 * doc + 5 * j + t) % 7 < 3 + j % 3 for doc in range(20)]
            samples[task] = {d: Sample(d, r, ["text"], "target", "prompt") for d, r in enumerate(right)}
            outcomes[task] = Outcome(
                name, task, sum(right) / 20, "exact_match", 20, None if single else 2.0 + 9 * j,
                None if single else 0.8, 5.0 + 4 * j, 400, 30.0, False,
            )  # fmt: skip
        runs.append(Run(Path("."), name, single, [], outcomes, samples, {}, False))
    return runs


def test_the_plots_fit_real_configuration_names_at_1400_px(tmp_path: Path) -> None:
    """In Chromium at 1400 px the accuracy plot keeps most of the width, its legend stands
    between the plots inside the page without covering either, the speed plot keeps room for
    its bars (its labels are the leaderboard's keys), and every configuration's marks are drawn
    inside the accuracy plot's area of the screenshot."""
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    from lm_eval_safe.leaderboard.plots import ACCURACY_AXES, LEGEND, SPEED_AXES, color

    binary = find_chromium()
    if binary is None:
        if os.environ.get("LM_EVAL_SAFE_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    runs = _named_runs()
    assert all(60 <= len(r.config) <= 100 for r in runs if not r.is_single), [r.config for r in runs]
    page_path = tmp_path / "report.html"
    page_path.write_text(build_report(runs, [tmp_path]))
    rect = "(id => { const r = document.getElementById(id).getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; })"
    with HeadlessPage(binary, width=1400) as page:
        page.open(page_path)
        assert page.evaluate("[...document.querySelectorAll('#leaderboard tr.leaderboard-row')].map(r => r.dataset.key)") == [
            f"C{i + 1}" for i in range(len(runs))
        ]
        page.evaluate("document.querySelector('.plots').scrollIntoView()")
        width = page.evaluate("document.documentElement.clientWidth")
        plots = page.evaluate("(() => { const r = document.querySelector('.plots svg').getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; })()")
        accuracy, legend, speed = (page.evaluate(f"{rect}('{gid}')") for gid in (ACCURACY_AXES, LEGEND, SPEED_AXES))
        shot = page.screenshot(tmp_path / "plots.png")
    assert plots[0] >= 0 and plots[2] <= width
    assert accuracy[2] - accuracy[0] >= 0.4 * width, accuracy  # was 95 px with the names as labels
    assert accuracy[2] <= legend[0] and legend[2] <= speed[0], (accuracy, legend, speed)
    assert legend[0] >= 0 and legend[2] <= width
    assert speed[2] - speed[0] >= 0.12 * width and speed[2] <= width, speed
    image = imread(shot)[..., :3]
    assert image.shape[1] == 1400
    left, top, right, bottom = (round(v) for v in accuracy)
    area = image[max(0, top) : bottom, left:right]
    for j, run in enumerate(runs):
        close = (abs(area - to_rgb(color(j))).max(axis=-1) < 0.08).sum()
        assert close >= 20, f"{run.config}: {close} pixels of its colour in the accuracy plot"


def test_the_gap_test_is_exact_mcnemar() -> None:
    """Against scipy's exact binomial test on the discordant questions, and on hand-set
    verdicts in the leaderboard (the ensemble against the best member alone)."""
    from scipy.stats import binomtest

    from lm_eval_safe.leaderboard.report import mcnemar_exact

    for fixed in range(13):
        for broken in range(13):
            n = fixed + broken
            expected = 1.0 if n == 0 else binomtest(fixed, n, 0.5).pvalue
            assert mcnemar_exact(fixed, broken) == pytest.approx(expected, abs=1e-12)
    runs = _named_runs()
    best = max((r for r in runs if r.is_single), key=lambda r: r.outcomes["safe_gsm8k"].accuracy)
    ensemble = runs[4]
    mine, theirs = ensemble.samples["safe_gsm8k"], best.samples["safe_gsm8k"]
    fixed = sum(1 for d in mine if mine[d].correct and not theirs[d].correct)
    broken = sum(1 for d in mine if theirs[d].correct and not mine[d].correct)
    assert fixed + broken > 0
    page = build_report(runs, [Path(".")])
    row = page[page.index('data-key="C5"') :]
    assert f"+{fixed} / −{broken}, p = {binomtest(fixed, fixed + broken, 0.5).pvalue:.2g}</td>" in row[: row.index("</tr>")]
