"""Data parallel: two CPU processes (gloo) give the same generations and metrics as one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, gen_request, make_lm, run_gsm8k_cli, torchrun, write_apples_gsm8k

from lm_eval_safe.decoder.stats import GenerationStats

pytestmark = pytest.mark.slow  # whole processes and end-to-end runs: the slow tier



def test_two_processes_match_one(tmp_path: Path, tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    write_apples_gsm8k(tmp_path / "data")
    model_args = f"members={tiny_bpe_dir},{tiny_sp_dir},device=cpu"
    single = run_gsm8k_cli([sys.executable], model_args, tmp_path / "data", tmp_path / "one")
    double = run_gsm8k_cli(torchrun(2), model_args, tmp_path / "data", tmp_path / "two")
    assert sorted(double["resps"]) == list(range(5))
    assert double["resps"] == single["resps"]
    one, two = single["results"], double["results"]
    assert two["results"]["safe_gsm8k"] == one["results"]["safe_gsm8k"]
    assert two["config"]["world_size"] == 2 and one["config"]["world_size"] == 1
    # all ranks' statistics are reported, not rank 0's alone (the padded duplicate may add one)
    assert two["config"]["safe_stats"]["cycles"] >= one["config"]["safe_stats"]["cycles"]


class _TwoRanksInOneProcess:
    """Stands in for the process group of rank 0 of 2: the other rank's statistics are canned,
    and every collective is recorded, so collective placement is tested without torchrun."""

    rank, world_size, device = 0, 2, None

    def __init__(self, other: GenerationStats):
        self.other = other
        self.collectives: list[str] = []

    def all_gather_object(self, obj: object) -> list[object]:
        self.collectives.append("all_gather_object")
        return [obj, self.other]

    def barrier(self) -> None:
        self.collectives.append("barrier")


def _as_rank_zero_of_two(lm: object, other: GenerationStats) -> _TwoRanksInOneProcess:
    group = _TwoRanksInOneProcess(other)
    lm.process_group, lm._world_size = group, 2  # type: ignore[attr-defined]
    return group


def test_barrier_sums_every_ranks_statistics(tiny_bpe_dir: Path) -> None:
    """lm-eval calls barrier() on every rank after each request type: the stats are summed there."""
    lm = make_lm(tiny_bpe_dir)
    lm.run_stats = GenerationStats(generated_tokens=3, cycles=1)
    group = _as_rank_zero_of_two(lm, GenerationStats(generated_tokens=5, cycles=2))
    lm.barrier()
    assert group.collectives == ["all_gather_object"]
    assert lm.total_stats == GenerationStats(generated_tokens=8, cycles=3)
    assert lm.get_model_info()["safe_stats"]["generated_tokens"] == 8
    lm.barrier()  # a second request type: the sum is recomputed, not added twice
    assert lm.total_stats == GenerationStats(generated_tokens=8, cycles=3)


def test_generate_until_takes_part_in_no_collective(tiny_bpe_dir: Path) -> None:
    """With --use_cache, lm-eval's CachingLM skips generate_until on a fully cached rank: a
    collective inside it would wait forever for that rank (barrier() sums the stats instead)."""
    lm = make_lm(tiny_bpe_dir)
    group = _as_rank_zero_of_two(lm, GenerationStats())
    (text,) = lm.generate_until([gen_request("Tom has 3 apples", until=[], max_gen_toks=4)], disable_tqdm=True)
    assert isinstance(text, str)
    assert group.collectives == []


def test_more_processes_than_documents_fails_fast(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    """3 processes, 2 documents: lm-eval 0.4.13 itself refuses the empty rank ("did not find any
    docs") before any request reaches the model, and torchrun stops the other ranks. The run must
    end (no rank left waiting in a collective); should a later lm-eval run empty ranks, it must
    then succeed with both documents."""
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    questions = [{"question": f"Tom has {n} apples. How many?", "answer": f"x\n#### {n}"} for n in range(2)]
    (data / "test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    out = tmp_path / "out"
    cmd = [
        *torchrun(3),
        "-m", "lm_eval", "--model", "safe-ensemble",
        "--model_args", f"members={tiny_bpe_dir},device=cpu", "--gen_kwargs", "max_gen_toks=4",
        "--tasks", "safe_gsm8k", "--include_path", str(REPO / "tasks"),
        "--metadata", json.dumps({"data_dir": str(tmp_path / "data")}), "--output_path", str(out),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    if proc.returncode != 0:
        assert "did not find any docs" in proc.stderr, proc.stderr[-3000:]
    else:
        (results,) = out.rglob("results_*.json")
        assert json.loads(results.read_text())["n-samples"]["safe_gsm8k"]["effective"] == 2
