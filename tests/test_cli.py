"""The commands a user types, on tiny models: ``lm-eval-safe`` and ``lm_eval.simple_evaluate``
with the literal ``members=a,b`` string."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import evaluate_gsm8k as _simple_evaluate
from helpers import write_gsm8k as _tiny_gsm8k


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


def test_simple_evaluate_batch_size_gives_the_same_responses(
    tmp_path: Path, tiny_bpe_dir: Path, tiny_gemma_dir: Path
) -> None:
    """lm-eval's own ``batch_size`` argument reaches generation: 4 rows at a time, refilled,
    give the responses of one at a time (float64, see tests/test_batching.py)."""
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
