"""lm-eval's ``--use_cache`` with safe-ensemble: nothing lost, nothing mixed.

lm-eval keys cached responses by the request alone; the backend gives each configuration (member
set and output-changing options) its own table in the user's file. These tests run lm-eval
itself: in-process for two configurations on one path, and as a real subprocess killed with
SIGKILL half-way through a task for resuming."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import evaluate_gsm8k, make_lm, write_gsm8k

import lm_eval_safe

pytestmark = pytest.mark.slow  # whole processes and end-to-end runs: the slow tier

ROWS = [
    {"question": f"{name} has {a} {item} and buys {b} more. How many {item} now?", "answer": f"#### {a + b}"}
    for name, item, a, b in [
        ("Tom", "apples", 2, 3),
        ("Ann", "pens", 10, 7),
        ("Weng", "books", 4, 4),
        ("Zoë", "coins", 31, 12),
        ("Mark", "eggs", 5, 9),
        ("Julie", "cards", 8, 1),
        ("Ken", "stamps", 6, 6),
        ("Tina", "shells", 12, 30),
        ("José", "kites", 3, 14),
        ("Betty", "cups", 21, 2),
    ]
]


def test_cache_namespace_depends_on_exactly_the_output_options(
    tmp_path: Path, tiny_bpe_dir: Path, tiny_sp_dir: Path, tiny_gemma_dir: Path
) -> None:
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    base_options = lm.options
    base = lm.cache_namespace
    changes_output = {
        "schedule": "every",
        "aggregator": "gac",
        "sharpen": "none",
        "sharpen_lambda": 0.2,
        "top_k": 5,
        "reference": "authors",
        "weights": [2.0, 1.0],
        "draft_len": 3,
        "threshold": 0.3,
        "ll_aggregate": "logmean",
        "max_length": 128,
        "max_gen_toks": 17,
        "add_bos_token": True,
        "trust_remote_code": True,
    }
    seen = {base}
    for key, value in changes_output.items():
        lm.options = dataclasses.replace(base_options, **{key: value})
        assert lm.cache_namespace not in seen, key
        seen.add(lm.cache_namespace)
    speed_only = {
        "batch_size": 4,
        "max_batch_size": 3,
        "device": "cpu",
        "member_devices": ["cpu", "cpu"],
        "verifier_cache": False,
        "cache_dir": str(tmp_path / "elsewhere"),
    }
    for key, value in speed_only.items():
        lm.options = dataclasses.replace(base_options, **{key: value})
        assert lm.cache_namespace == base, key

    # member set, drafter, member order, dtype: other LMs
    others = [
        make_lm(tiny_bpe_dir, tiny_gemma_dir),
        make_lm(tiny_bpe_dir, tiny_sp_dir, drafter=1),
        make_lm(tiny_sp_dir, tiny_bpe_dir),
        make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64"),
        make_lm(tiny_bpe_dir),
    ]
    for other in others:
        assert other.cache_namespace not in seen
        seen.add(other.cache_namespace)
    assert make_lm(tiny_bpe_dir, tiny_sp_dir, batch_size=3, verifier_cache=False).cache_namespace == base

    # the same folder name with other weights (a re-saved checkpoint) is another member
    copy = tmp_path / "copy" / tiny_bpe_dir.name
    shutil.copytree(tiny_bpe_dir, copy)
    before = make_lm(copy, tiny_sp_dir).cache_namespace
    weights = copy / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert make_lm(copy, tiny_sp_dir).cache_namespace != before


def _responses(results: dict) -> list[Any]:
    return [s["resps"] for s in sorted(results["samples"]["safe_gsm8k"], key=lambda s: s["doc_id"])]


def test_two_member_sets_on_one_cache_path(
    tmp_path: Path, tiny_bpe_dir: Path, tiny_sp_dir: Path, tiny_gemma_dir: Path
) -> None:
    """The second member set (or another drafter) on the first one's --use_cache path computes
    its own answers; the first configuration run again gets its own back, computing nothing."""
    data = write_gsm8k(tmp_path, ROWS[:4])
    cache = str(tmp_path / "requests")

    def run(model_args: str, use_cache: str | None = cache) -> tuple[list[Any], int]:
        results = evaluate_gsm8k(
            data, model_args, limit=4, gen_kwargs={"max_gen_toks": 12}, log_samples=True,
            use_cache=use_cache,
        )
        return _responses(results), results["config"]["safe_stats"]["requests"]

    first, computed = run(f"members={tiny_bpe_dir},{tiny_sp_dir}")
    assert computed == 4
    second, computed = run(f"members={tiny_bpe_dir},{tiny_gemma_dir}")
    assert computed == 4, "another member set must not be answered from the first's cache"
    assert second != first, "the test needs member sets that answer differently"
    assert second == run(f"members={tiny_bpe_dir},{tiny_gemma_dir}", use_cache=None)[0]
    drafted, computed = run(f"members={tiny_bpe_dir},{tiny_sp_dir},drafter=1")
    assert computed == 4 and drafted != first
    again, computed = run(f"members={tiny_bpe_dir},{tiny_sp_dir}")
    assert computed == 0 and again == first

    with sqlite3.connect(f"{cache}_rank0.db") as db:
        tables = {
            name: db.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0]
            for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
    assert tables.pop("unnamed", 0) == 0  # lm-eval's shared default table stays empty
    assert sorted(tables.values()) == [4, 4, 4]
    assert all(name.startswith("safe-ensemble-") for name in tables)


def _lm_eval(data: Path, members: str, cache: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "lm_eval", "--model", "safe-ensemble",
        "--model_args", f"members={members}",
        "--tasks", "safe_gsm8k", "--include_path", lm_eval_safe.task_dir(),
        "--metadata", json.dumps({"data_dir": str(data)}),
        "--limit", str(len(ROWS)), "--gen_kwargs", "max_gen_toks=40",
        "--use_cache", str(cache), "--output_path", str(out), "--log_samples",
    ]  # fmt: skip


def _cached_rows(db_path: Path) -> int:
    """Rows in safe-ensemble's table of a --use_cache file (0 while it does not exist yet)."""
    try:
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5) as db:
            (table,) = [
                n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
                if n.startswith("safe-ensemble-")
            ]  # fmt: skip
            return int(db.execute(f'SELECT COUNT(*) FROM "{table}"').fetchone()[0])
    except (sqlite3.OperationalError, ValueError):
        return 0


def _finished(out: Path) -> tuple[dict, list[tuple[int, Any, Any]]]:
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_safe_gsm8k_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    per_doc = sorted((r["doc_id"], r["resps"], r["exact_match"]) for r in rows)
    return json.loads(results.read_text()), per_doc


def test_killed_run_resumes_with_nothing_lost_or_mixed(
    tmp_path: Path, tiny_bpe_dir: Path, tiny_sp_dir: Path
) -> None:
    """SIGKILL a --use_cache run once k of n requests are cached; the same command again
    computes exactly the n - k others, and its results equal an uninterrupted run's."""
    data = write_gsm8k(tmp_path, ROWS)
    members = f"{tiny_bpe_dir},{tiny_sp_dir}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    cache, out = tmp_path / "requests", tmp_path / "killed"
    command = _lm_eval(data, members, cache, out)
    victim = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    db = Path(f"{cache}_rank0.db")
    deadline = time.monotonic() + 300
    while _cached_rows(db) < 2:
        assert victim.poll() is None, f"the run ended before it was killed: {victim.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "no request finished within 300 s"
        time.sleep(0.02)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=60)
    victim.stderr.close()
    done = _cached_rows(db)
    assert 2 <= done < len(ROWS), "the kill must land half-way through the task"
    assert not list(out.rglob("results_*.json"))

    resumed = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Cached requests: {done}, Requests remaining: {len(ROWS) - done}" in resumed.stderr
    resumed_results, resumed_docs = _finished(out)
    assert resumed_results["config"]["safe_stats"]["requests"] == len(ROWS) - done

    fresh = subprocess.run(
        _lm_eval(data, members, tmp_path / "fresh-requests", tmp_path / "fresh"),
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    fresh_results, fresh_docs = _finished(tmp_path / "fresh")
    assert fresh_results["config"]["safe_stats"]["requests"] == len(ROWS)
    assert resumed_docs == fresh_docs
    assert len({str(resps) for _, resps, _ in fresh_docs}) > 1
    assert resumed_results["results"] == fresh_results["results"]
    assert _cached_rows(db) == len(ROWS)
