"""``scripts/check_gpu.sh``'s dry run in its quickest form: the same four parts as on a GPU,
on this CPU with tiny members and the tests' tiny tokenizers, one JSON report.

Why it runs in the suite: the GPU run happens on a machine lent for minutes, where nothing can
be fixed in time; what can fail here (arguments, the parts' code, the merge, lm-eval's command
line from the working tree) must fail here. The parts compare against independent references
inside the check itself (transformers' ``generate``, the ``aligned`` schedule), and the test
reads their verdicts and counts from the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, write_apples_gsm8k
from tiny_tokenizers import train_byte_bpe_tokenizer, train_sentencepiece_style_tokenizer

pytestmark = pytest.mark.slow  # whole processes and end-to-end runs: the slow tier

SCRIPT = REPO / "scripts" / "check_gpu.sh"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Tokenizer folders a/ (byte-level BPE) and b/ (SentencePiece-style), and 8 questions."""
    root = tmp_path_factory.mktemp("check_gpu")
    train_byte_bpe_tokenizer().save_pretrained(root / "tokenizers" / "a")
    train_sentencepiece_style_tokenizer().save_pretrained(root / "tokenizers" / "b")
    return root / "tokenizers", write_apples_gsm8k(root / "data", n=8)


def run_check(*args: str, out: Path | None = None, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable)
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_quick_dry_run_writes_every_part(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    tokenizers, data = inputs
    args = ["--tokenizers", str(tokenizers), "--data-dir", str(data), "--warm-up", "1"]
    proc = run_check("--quick", *args, out=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads((tmp_path / "check_gpu.json").read_text())
    assert report["dry_run"] is True
    for part in ("parity", "theorem1", "speed", "lm_eval"):
        assert report[part]["status"] == "ran" and report[part]["passed"], part

    parity = report["parity"]["result"]["float32"]  # SAFE alone against transformers' generate
    assert parity["equal_to_generate"] == parity["batch8_equal_to_batch1"] == parity["prompts"] == 8
    assert parity["differences_from_generate"] == []

    theorem = report["theorem1"]["result"]["float32"]  # safe against aligned
    for batch in ("batch1", "batch8"):
        run = theorem[batch]
        assert run["equal"] == run["prompts"] == 8
        assert 0 < run["ensemble_ops_safe"] < run["ensemble_ops_aligned"]
        assert run["ensemble_ops_aligned"] - run["ensemble_ops_safe"] == run["consensus_skips_safe"]

    assert report["speed"]["result"]["warm_up_ms_per_token"]  # at least one round
    rows = report["speed"]["result"]["rows"]
    assert len(rows) == 16  # 2 pairs x batch 1 and 8 x 4 methods
    assert {(r["pair"], r["batch"], r["method"]) for r in rows} == {
        (pair, batch, method)
        for pair in ("8b+1.7b", "8b+8b-perturbed")
        for batch in (1, 8)
        for method in ("generate", "drafter", "safe", "safe_overlap")
    }
    for row in rows:
        assert row["tokens"] == (2 * 4 if row["batch"] == 1 else 8 * 2)  # EOS masked: every budget
        assert row["method"] != "generate" or row["over_generate"] == 1.0

    lm_eval = report["lm_eval"]["result"]
    assert lm_eval["returncode"] == 0 and lm_eval["documents"] == 8
    assert lm_eval["safe_stats"]["requests"] == 8 and lm_eval["safe_stats"]["generated_tokens"] > 0
    assert "check_gpu.sh: lm_eval" in (tmp_path / "check_gpu.log").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "parity,bogus"], "unknown part 'bogus'"),
        (["--limit", "speed"], "--limit takes PART=SECONDS"),
        (["--limit", "nothing=3"], "unknown part 'nothing'"),
        (["--frobnicate"], "unknown argument '--frobnicate'"),
        (["--only", ""], "--only names no part"),
    ],
)
def test_bad_arguments_are_one_line_errors(args: list[str], message: str, tmp_path: Path) -> None:
    proc = run_check(*args, out=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr.strip().splitlines()[-1]


def test_missing_tokenizers_are_one_line_errors(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    _, data = inputs
    proc = run_check("--quick", "--only", "parity", "--tokenizers", str(tmp_path / "none"), "--data-dir", str(data), out=tmp_path)
    assert proc.returncode == 1
    assert f"no tokenizer in {tmp_path / 'none' / 'a'}" in proc.stdout
    assert json.loads((tmp_path / "check_gpu.json").read_text())["parity"]["status"] == "exit 1"
