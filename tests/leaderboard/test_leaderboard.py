"""End-to-end test of lm-eval-safe leaderboard on the tiny in-process models.

Why: the leaderboard script glues lm-eval, the backend and the tasks together; its value is
that one command produces a complete table and plot and that an interrupted run resumes.
Tiny models (random weights) give meaningless accuracies, so the test checks structure --
a row per configuration, a real PNG, per-configuration cache files, and that a second
invocation reads the cache instead of running lm-eval again -- not numbers.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import ModuleType

import pytest
from helpers import parse_lm_eval_command

from lm_eval_safe.leaderboard.configs import ENSEMBLE_CONFIGS, build_configs
from lm_eval_safe.leaderboard.report import wilson_interval

pytestmark = pytest.mark.slow  # whole processes and end-to-end runs: the slow tier

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

GSM8K_ROWS = [
    {"question": "Tom has 2 apples and buys 3 more. How many apples?", "answer": "2+3=5\n#### 5"},
    {"question": "A box holds 4 pens. How many pens in 2 boxes?", "answer": "4*2=8\n#### 8"},
    {"question": "Sara had 10 coins and lost 7. How many are left?", "answer": "10-7=3\n#### 3"},
]


def _load_compare() -> ModuleType:
    """The leaderboard's command line (``lm-eval-safe leaderboard``)."""
    from lm_eval_safe.leaderboard import cli

    return cli


@pytest.fixture(scope="module")
def compare() -> ModuleType:
    pytest.importorskip("matplotlib")
    return _load_compare()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A 3-question GSM8K in the layout safe_utils.load_gsm8k expects (<dir>/gsm8k/test.jsonl)."""
    folder = tmp_path / "data" / "gsm8k"
    folder.mkdir(parents=True)
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    return tmp_path / "data"


def test_compare_end_to_end_and_resume(
    compare: ModuleType,
    tiny_bpe_dir: Path,
    tiny_sp_dir: Path,
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    argv = [
        "--members",
        f"{tiny_bpe_dir},{tiny_sp_dir}",
        "--tasks",
        "safe_gsm8k",
        "--limit",
        "2",
        "--max-gen-toks",
        "4",
        "--data-dir",
        str(data_dir),
        "--out",
        str(out),
        "--model-args-extra",
        f"device=cpu,cache_dir={tmp_path / 'safe_cache'}",
        "--save-samples",
    ]
    assert compare.main(argv) == 0
    first = capsys.readouterr().out

    configs = build_configs([str(tiny_bpe_dir), str(tiny_sp_dir)], None)
    names = [c.name for c in configs]
    # two members alone + every built-in ensemble configuration
    assert len(names) == 2 + len(ENSEMBLE_CONFIGS)
    assert first.count(": start (") == len(names)
    assert first.count(": done in ") == len(names)

    table = (out / "leaderboard.md").read_text()
    for name in names:
        rows = [line for line in table.splitlines() if line.startswith(f"| {name} |")]
        # one row in the overview table and one in the task's detail table
        assert len(rows) == 2, (name, rows)
        assert "not run" not in rows[1]
    assert "95% CI (Wilson)" in table and "E/T %" in table
    # ensembles print the gap to the best member alone, as the paper does: "12.3 (+4.5)"
    ensemble_row = next(line for line in table.splitlines() if line.startswith("| unite-safe |"))
    assert "(+" in ensemble_row or "(-" in ensemble_row

    png = out / "leaderboard.png"
    assert png.read_bytes()[:8] == PNG_MAGIC

    # --save-samples: lm-eval folders per cell, traced ensembles, and the HTML report over them
    page = (out / "leaderboard.html").read_text()
    assert page.count('class="leaderboard-row"') == len(names)
    traced = {p.parent.parent.name for p in (out / "lm_eval").rglob("traces_safe_gsm8k_*.jsonl")}
    assert len(traced) == len(ENSEMBLE_CONFIGS)

    cache_files = sorted((out / "cache").glob("*__safe_gsm8k__limit2__*.json"))
    records = [
        json.loads(p.read_text()) for p in cache_files if not p.name.endswith(".samples.json")
    ]
    assert len(records) == len(names)
    settings = compare.run_settings(compare.parse_args(argv))
    by_name = {c.name: c for c in configs}
    for record in records:
        assert record["summary"]["n"] == 2
        assert "exact_match,none" in record["summary"]["results"]["safe_gsm8k"]
        generated = record["summary"]["safe_stats"]["generated_tokens"]
        assert 2 <= generated <= 2 * 4, "2 requests of 1 to max_gen_toks=4 tokens each"
        config = by_name[record["config"]]
        if not config.is_single:  # the traces hold each request's drafted ids: the same count
            traces = compare.cell_run_dir(config, "safe_gsm8k", settings).rglob("traces_safe_gsm8k_*.jsonl")
            lines = [json.loads(line) for path in traces for line in path.read_text().splitlines()]
            assert len(lines) == 2 and generated == sum(len(line["ids"]) for line in lines), record["config"]
    ensembles = [r for r in records if r["config"] == "unite-every"]
    assert ensembles and ensembles[0]["summary"]["safe_stats"]["ensemble_rate_percent"] > 0

    # Resume: a second run reads every result from the cache and runs nothing.
    png.unlink()
    assert compare.main(argv) == 0
    second = capsys.readouterr().out
    assert ": start (" not in second
    assert second.count(": cached (") == len(names)
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert (out / "leaderboard.md").read_text() == table

    # --report-only never runs anything: settings with no cached results show as "not run".
    report_argv = [*argv, "--report-only", "--markdown", str(tmp_path / "partial.md")]
    report_argv[report_argv.index("--limit") + 1] = "3"
    assert compare.main(report_argv) == 0
    third = capsys.readouterr().out
    assert ": start (" not in third and third.count("not run yet") == len(names)
    assert "| unite-safe | not run |" in (tmp_path / "partial.md").read_text()


def test_limits_configs_and_interval(compare: ModuleType) -> None:
    assert compare.parse_limits("3", ["a", "b"]) == {"a": 3, "b": 3}
    assert compare.parse_limits("a=2,b=0.5", ["a", "b"]) == {"a": 2, "b": 0.5}
    assert compare.parse_limits(None, ["a"]) == {"a": None}
    with pytest.raises(SystemExit):
        compare.parse_limits("c=1", ["a"])

    configs = build_configs(["m1", "/x/m2.gguf"], ["unite-safe", "alone"])
    # members alone always come first: the gap column refers to them
    assert [c.name for c in configs] == ["alone:m1", "alone:m2", "unite-safe"]
    assert configs[1].model_args == "members=/x/m2.gguf"
    assert configs[2].model_args.startswith("members=m1|/x/m2.gguf,schedule=safe")
    with pytest.raises(SystemExit):
        build_configs(["m1"], ["nonsense"])

    lo, hi = wilson_interval(0.0, 5)
    assert lo == 0.0 and 0.4 < hi < 0.5
    lo, hi = wilson_interval(0.5, 100)
    assert lo == pytest.approx(0.404, abs=1e-3) and hi == pytest.approx(0.596, abs=1e-3)


def test_paper_preset_dry_run_prints_the_exact_commands(
    compare: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--preset paper --dry-run``: one lm_eval command per (pair, configuration, task) of the
    paper's Table 2, each accepted by lm-eval's own CLI parser and by the backend's options;
    the table prints the paper's number beside each cell docs/algorithm.md (The paper's numbers) gives; nothing runs."""
    from lm_eval_safe.options import parse_options

    out = tmp_path / "paper"
    assert compare.main(["--preset", "paper", "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert not out.exists(), "a dry run runs and writes nothing"
    assert all(line.startswith(("lm_eval ", "# ")) for line in printed.splitlines() if line)

    pairs = {
        ("internlm/internlm3-8b-instruct", "Qwen/Qwen2.5-7B-Instruct"),
        ("Qwen/Qwen2.5-7B-Instruct", "LGAI-EXAONE/EXAONE-3.5-7.8B-Instruct"),
    }
    tasks = {"safe_math500", "safe_gsm8k", "safe_bbh_paper"}
    cells = set()
    for line in printed.splitlines():
        if not line.startswith("lm_eval "):
            continue
        args = parse_lm_eval_command(shlex.split(line))
        assert args["model"] == "safe-ensemble" and args["apply_chat_template"] is True
        assert args["gen_kwargs"] == {"max_gen_toks": 2048}
        assert args["use_cache"] and args["output_path"] and args["include_path"]
        (task,) = args["tasks"]
        options = parse_options(args["model_args"])
        assert options.dtype == "bfloat16" and options.trust_remote_code is True
        if len(options.members) == 1:
            assert options.device == "cuda:0" and options.member_devices is None
            config = ("alone", options.members[0])
        else:
            assert options.member_devices == ["cuda:0", "cuda:1"]
            assert tuple(options.members) in pairs
            assert options.drafter == options.members[0].split("/")[1]
            config = (options.schedule, options.aggregator, tuple(options.members))
        cells.add((config, task))
    ensembles = {("every", "unite"), ("safe", "unite"), ("threshold", "gac"), ("safe", "gac")}
    expected = {
        (("alone", m), t) for pair in pairs for m in pair for t in tasks
    } | {((s, a, pair), t) for pair in pairs for s, a in ensembles for t in tasks}
    assert cells == expected
    # Qwen2.5 alone belongs to both pairs and runs once: 3 members alone + 2 pairs x 4, x 3 tasks
    assert sum(line.startswith("lm_eval ") for line in printed.splitlines()) == (3 + 8) * 3
    assert printed.count(": as above") == 3

    for row in (
        "| alone:internlm3-8b-instruct | - [paper 74.8] | - [paper 90.14] | - [paper 82.26] |",
        "| unite-every (UniTE) | - [paper 59.6] | - [paper 75.06] | - [paper 79.58] |",
        "| unite-safe (UniTE+SAFE) | - [paper 77.4] | - [paper 92.04] | - [paper 82.97] |",
        "| gac-threshold (GaC) | - [paper 74.2] | - [paper 91.28] | - [paper 82.34] |",
        "| gac-safe (GaC+SAFE) | - [paper 76.0] | - [paper 91.36] | - [paper 82.34] |",
        "| gac-safe (GaC+SAFE) | not run [paper 76.0] | - | - | - [paper 0.71] | - | - | - | - |",
    ):
        assert f"# {row}" in printed, row
    second = printed[printed.index("# qwen2.5-7b+exaone3.5-7.8b") :]
    assert "no paper numbers" in second.splitlines()[0] and "[paper" not in second


def test_chat_template_leaderboard_runs_a_base_member_alone_on_plain_prompts(
    compare: ModuleType,
    tiny_bpe_dir: Path,
    tiny_sp_dir: Path,
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--apply-chat-template`` with an instruct member and a base member (no template): the
    base member alone runs on the plain prompt, as it does inside the ensemble, instead of the
    backend's refusal stopping the leaderboard; the other cells use the template."""
    import shutil

    chat_dir = tiny_bpe_dir  # the tiny members carry chat templates; a copy of one without
    base_dir = tmp_path / "tiny_base"
    shutil.copytree(tiny_sp_dir, base_dir)
    (base_dir / "chat_template.jinja").unlink()
    config_path = base_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))

    out = tmp_path / "out"
    argv = [
        "--members", f"{chat_dir},{base_dir}",
        "--tasks", "safe_gsm8k", "--limit", "1", "--max-gen-toks", "3",
        "--configs", "alone,unite-safe", "--apply-chat-template",
        "--data-dir", str(data_dir), "--out", str(out),
        "--model-args-extra", f"device=cpu,cache_dir={tmp_path / 'safe_cache'}",
        "--save-samples",
    ]  # fmt: skip
    assert compare.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"alone:{base_dir.name}: no chat template; this cell runs on plain prompts" in printed
    records = {
        r["config"]: r
        for r in (json.loads(p.read_text()) for p in (out / "cache").glob("*.json"))
        if "summary" in r
    }
    assert {name: r["apply_chat_template"] for name, r in records.items()} == {
        f"alone:{chat_dir.name}": True,
        f"alone:{base_dir.name}": False,
        "unite-safe": True,
    }
