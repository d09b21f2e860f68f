"""Data parallel: two CPU processes (gloo) give the same generations and metrics as one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(prefix: list[str], members: str, data_dir: Path, out: Path) -> dict:
    cmd = [
        *prefix, "-m", "lm_eval", "run",
        "--model", "safe-ensemble",
        "--model_args", f"members={members},device=cpu", "--gen_kwargs", "max_gen_toks=8",
        "--tasks", "safe_gsm8k",
        "--include_path", str(REPO / "tasks"),
        "--metadata", json.dumps({"data_dir": str(data_dir)}),
        "--limit", "5", "--log_samples", "--output_path", str(out),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_safe_gsm8k_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return {
        "results": json.loads(results.read_text()),
        # lm-eval pads the shorter rank with a copy of its last request, whose answer it
        # appends to that instance's responses: compare the first response of each document
        "resps": {r["doc_id"]: r["resps"][0][0] for r in rows},
    }


def test_two_processes_match_one(tmp_path: Path, tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    questions = [
        {"question": f"Tom has {n} apples and buys {n + 2} more. How many now?", "answer": f"x\n#### {2 * n + 2}"}
        for n in range(5)
    ]
    (data / "test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    members = f"{tiny_bpe_dir},{tiny_sp_dir}"
    single = _run([sys.executable], members, tmp_path / "data", tmp_path / "one")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    double = _run(torchrun, members, tmp_path / "data", tmp_path / "two")
    assert sorted(double["resps"]) == list(range(5))
    assert double["resps"] == single["resps"]
    one, two = single["results"], double["results"]
    assert two["results"]["safe_gsm8k"] == one["results"]["safe_gsm8k"]
    assert two["config"]["world_size"] == 2 and one["config"]["world_size"] == 1
    # all ranks' statistics are reported, not rank 0's alone (the padded duplicate may add one)
    assert two["config"]["safe_stats"]["cycles"] >= one["config"]["safe_stats"]["cycles"]
