"""The commands a user types, on tiny models: ``lm-eval-safe`` and ``lm_eval.simple_evaluate``
with the literal ``members=a,b`` string."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import evaluate_gsm8k as _simple_evaluate
from helpers import write_gsm8k as _tiny_gsm8k


@pytest.mark.slow
def test_console_command_finds_its_tasks(tmp_path: Path, tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    data = _tiny_gsm8k(tmp_path)
    exe = Path(sys.executable).with_name("lm-eval-safe")
    assert exe.is_file(), "the console script is installed with the package"
    cmd = [
        str(exe), "--model_args", f"members={tiny_bpe_dir},{tiny_sp_dir},drafter=1",
        "--tasks", "safe_gsm8k", "--metadata", json.dumps({"data_dir": str(data)}),
        "--gen_kwargs", "max_gen_toks=4", "--limit", "1", "--output_path", str(tmp_path / "out"),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    config = json.loads(results.read_text())["config"]
    assert config["drafter"] == tiny_sp_dir.name
    assert results.parent.name == f"safe-ensemble__{tiny_bpe_dir.name}+{tiny_sp_dir.name}__drafter-{tiny_sp_dir.name}__safe-unite"


@pytest.mark.slow
def test_simple_evaluate_with_literal_members_string(tmp_path: Path, tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    results = _simple_evaluate(
        _tiny_gsm8k(tmp_path),
        f"members={tiny_bpe_dir},{tiny_sp_dir},schedule=every,dtype=float32",
        limit=2,
        gen_kwargs={"max_gen_toks": 4},
        batch_size=1,
    )
    config = results["config"]
    assert [m["name"] for m in config["members"]] == [tiny_bpe_dir.name, tiny_sp_dir.name]
    assert config["schedule"] == "every"
    assert config["safe_stats"]["ensemble_rate_percent"] == 100.0
    assert "safe_gsm8k" in results["results"]


@pytest.mark.slow
def test_simple_evaluate_batch_size_gives_the_same_responses(
    tmp_path: Path, tiny_bpe_dir: Path, tiny_gemma_dir: Path
) -> None:
    """lm-eval's own ``batch_size`` argument reaches generation: 4 rows at a time, refilled,
    give the responses of one at a time (float64, see tests/decoder/test_batch_driver.py)."""
    rows = [
        {"question": f"Tom has {a} apples and buys {b} more. How many now?", "answer": f"#### {a + b}"}
        for a, b in [(2, 3), (10, 7), (4, 4), (31, 12), (5, 9), (8, 1)]
    ]
    data = _tiny_gsm8k(tmp_path, rows)
    responses = {}
    for batch_size in (1, 4):
        results = _simple_evaluate(
            data,
            f"members={tiny_bpe_dir},{tiny_gemma_dir},dtype=float64",
            limit=6,
            gen_kwargs={"max_gen_toks": 16},
            batch_size=batch_size,
            log_samples=True,
        )
        samples = sorted(results["samples"]["safe_gsm8k"], key=lambda s: s["doc_id"])
        responses[batch_size] = [s["resps"] for s in samples]
        assert results["config"]["safe_options"]["batch_size"] == batch_size
    assert len(responses[1]) == 6
    assert len({str(r) for r in responses[1]}) > 1, "responses must differ for the check to mean anything"
    assert responses[4] == responses[1]


def _responses(results: dict, task: str) -> list[list[str]]:
    """Each doc's responses (its repeats), from the logged samples of the task's first filter."""
    samples = results["samples"][task]
    first_filter = samples[0]["filter"]
    ordered = sorted((s for s in samples if s["filter"] == first_filter), key=lambda s: s["doc_id"])
    return [s["resps"][0] for s in ordered]


@pytest.mark.slow
def test_self_consistency_task_with_use_cache(tmp_path: Path, tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """safe_gsm8k_sc end to end: 4 different samples per question, a majority-vote metric, and
    with ``--use_cache`` (which never reads do_sample=True requests) a second run that samples
    the same texts again."""
    data = _tiny_gsm8k(tmp_path)
    runs = []
    for _ in range(2):
        results = _simple_evaluate(
            data,
            f"members={tiny_bpe_dir},{tiny_sp_dir},aggregator=gac,seed=3",
            tasks="safe_gsm8k_sc",
            limit=2,
            gen_kwargs={"max_gen_toks": 8},
            log_samples=True,
            use_cache=str(tmp_path / "cache" / "lm"),
        )
        metrics = results["results"]["safe_gsm8k_sc"]
        assert "exact_match,maj@4" in metrics and "exact_match,score-first" in metrics
        runs.append(_responses(results, "safe_gsm8k_sc"))
    assert [len(r) for r in runs[0]] == [4, 4]
    assert all(len(set(r)) > 1 for r in runs[0]), runs[0]
    assert runs[1] == runs[0]


@pytest.mark.slow
def test_simple_evaluate_gen_kwargs_turn_on_sampling_seeded_by_lm_eval(
    tmp_path: Path, tiny_bpe_dir: Path, tiny_sp_dir: Path
) -> None:
    """``gen_kwargs="temperature=0.7,do_sample=True"`` samples a greedy task; lm-eval's own
    seed (``torch_random_seed``, the CLI's ``--seed``) decides the samples."""
    data = _tiny_gsm8k(tmp_path, [{"question": f"What is {a} plus 3?", "answer": f"#### {a + 3}"} for a in range(3)])
    responses = {}
    for seed in (1234, 1234, 99):
        results = _simple_evaluate(
            data,
            f"members={tiny_bpe_dir},{tiny_sp_dir}",
            limit=3,
            gen_kwargs="temperature=0.7,do_sample=True,max_gen_toks=8",
            log_samples=True,
            torch_random_seed=seed,
        )
        assert results["config"]["safe_stats"]["sampled_requests"] == 3
        responses.setdefault(seed, []).append(_responses(results, "safe_gsm8k"))
    assert responses[1234][0] == responses[1234][1]
    assert responses[99][0] != responses[1234][0]


def _readme_main_command() -> list[str]:
    """The README's main job: the first ``lm_eval --model safe-ensemble`` command it shows
    (``lm_eval`` or ``.venv/bin/lm_eval``)."""
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            words = shlex.split(line) if "--model safe-ensemble" in line else []
            if words and Path(words[0]).name == "lm_eval":
                return words
    raise AssertionError("README.md shows no lm_eval --model safe-ensemble command")


@pytest.mark.real
def test_readme_main_command_gives_real_answers(
    tmp_path: Path, real_models_dir: Path, shared_dir: Path
) -> None:
    """The README's command, as a new user runs it, on 2 documents and 24 new tokens: the
    default members answer (no empty responses, no empty-response warning)."""
    import lm_eval_safe

    command = _readme_main_command()
    assert "--apply_chat_template" in command
    replace = {
        "--limit": "2",
        "--gen_kwargs": "max_gen_toks=24",
        "--output_path": str(tmp_path / "out"),
        "--include_path": lm_eval_safe.task_dir(),
        "--metadata": json.dumps({"data_dir": str(shared_dir / "data")}),
    }
    for flag, value in replace.items():
        command[command.index(flag) + 1] = value
    env = dict(
        os.environ,
        LM_EVAL_SAFE_MODELS=str(real_models_dir),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", *command[1:]],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "responses are empty" not in proc.stderr
    (samples,) = (tmp_path / "out").rglob("samples_safe_gsm8k_*.jsonl")
    responses = [json.loads(line)["resps"][0][0] for line in samples.read_text().splitlines()]
    assert len(responses) == 2 and all(len(r.strip()) > 10 for r in responses), responses
    (results,) = (tmp_path / "out").rglob("results_*.json")
    stats = json.loads(results.read_text())["config"]["safe_stats"]
    assert stats["requests"] == 2 and stats["generated_tokens"] > 2 * 10
