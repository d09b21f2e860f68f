"""The options ``lm-eval-safe``'s subcommands share (:mod:`lm_eval_safe.cli_options`) and the
routing of its command line, without loading a model.

Why: the leaderboard and the benchmarks used to declare these ten times, with two member orders
and two ideas of where the data lies. The expectations below are the old scripts' defaults
(``bench_host.py``: ``gemma3-270m,smollm2-135m``, the drafter first; ``compare.py``: a preset's
settings unless given) and the lookup the docs describe (``--data-dir``, else
``$LM_EVAL_SAFE_DATA_DIR``, else ``../shared/data`` beside a checkout).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lm_eval_safe import cli, cli_options
from lm_eval_safe.cli_options import DEFAULT_MEMBERS, members_with_drafter_first

REPO = Path(__file__).resolve().parents[1]


def test_the_data_folder_is_the_option_else_the_variable_else_beside_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LM_EVAL_SAFE_DATA_DIR", raising=False)
    assert cli_options.repository_root() == REPO
    assert cli_options.default_data_dir() == REPO.parent / "shared" / "data"
    monkeypatch.setenv("LM_EVAL_SAFE_DATA_DIR", str(tmp_path))
    assert cli_options.local_data_dir(None, "lm-eval-safe bench x") == tmp_path.resolve()
    given = tmp_path / "given"
    given.mkdir()
    assert cli_options.local_data_dir(str(given), "lm-eval-safe bench x") == given.resolve()
    with pytest.raises(SystemExit, match=r"^lm-eval-safe bench x: data folder .*missing does not exist: pass --data-dir DIR or set LM_EVAL_SAFE_DATA_DIR$"):
        cli_options.local_data_dir(str(tmp_path / "missing"), "lm-eval-safe bench x")


def test_an_installed_wheel_without_data_gets_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LM_EVAL_SAFE_DATA_DIR", raising=False)
    monkeypatch.setattr(cli_options, "repository_root", lambda: None)
    with pytest.raises(SystemExit, match=r"^lm-eval-safe bench x: no data folder: pass --data-dir DIR or set LM_EVAL_SAFE_DATA_DIR \("):
        cli_options.local_data_dir(None, "lm-eval-safe bench x")
    assert cli_options.optional_data_dir(None) is None, "the leaderboard then reads the hub datasets"
    assert cli_options.optional_data_dir("hub") is None


def test_the_drafter_comes_first_named_as_drafter_names_it() -> None:
    assert members_with_drafter_first(["smollm2-135m", "gemma3-270m"], "gemma3-270m") == ["gemma3-270m", "smollm2-135m"]
    assert members_with_drafter_first(["/m/a", "/m/b", "/m/c"], "b") == ["/m/b", "/m/a", "/m/c"]
    assert members_with_drafter_first(["a", "b", "c"], "2") == ["c", "a", "b"]
    with pytest.raises(SystemExit, match=r"^--drafter: drafter='z' names no member"):
        members_with_drafter_first(["a", "b"], "z")


def test_bench_host_and_eval_keep_their_old_default_members_and_drafter() -> None:
    """The old defaults: bench_host.py ``gemma3-270m,smollm2-135m`` (the drafter first);
    bench_eval.py ``--drafter gemma3-270m --verifiers smollm2-135m``."""
    from lm_eval_safe.bench.commands import eval as bench_eval
    from lm_eval_safe.bench.commands import host

    assert DEFAULT_MEMBERS == "smollm2-135m,gemma3-270m"  # the README's main job
    for chosen in (host.member_specs, bench_eval.ordered_members):
        assert chosen(argparse.Namespace(members=DEFAULT_MEMBERS, drafter=None)) == ["gemma3-270m", "smollm2-135m"]
        assert chosen(argparse.Namespace(members="a,b", drafter=None)) == ["a", "b"]
        assert chosen(argparse.Namespace(members=DEFAULT_MEMBERS, drafter="0")) == ["smollm2-135m", "gemma3-270m"]


def leaderboard(argv: list[str]) -> argparse.Namespace:
    """``lm-eval-safe leaderboard ARGV``'s options as its run sees them."""
    from lm_eval_safe.leaderboard import cli as leaderboard_cli

    run, parsed = cli.parse(["leaderboard", *argv])
    assert run is leaderboard_cli.run
    return leaderboard_cli.finish_args(parsed)


def test_a_preset_sets_what_is_not_given_and_what_is_given_wins() -> None:
    """As compare.py's set_defaults did: the paper's settings, an option given (even one equal
    to the plain default) over them."""
    paper = leaderboard(["--preset", "paper", "--dry-run", "--data-dir", "hub"])
    assert paper.tasks == ["safe_math500", "safe_gsm8k", "safe_bbh_paper"]
    assert paper.configs == ["alone", "unite-every", "unite-safe", "gac-threshold", "gac-safe"]
    assert (paper.apply_chat_template, paper.runner, paper.max_gen_toks) == (True, "cli", 2048)
    assert paper.out == REPO / "benchmarks" / "runs" / "paper"
    given = leaderboard(["--preset", "paper", "--configs", "all", "--no-apply-chat-template", "--runner", "inprocess"])
    assert (given.configs, given.apply_chat_template, given.runner) == (["all"], False, "inprocess")
    plain = leaderboard(["--members", "a,b"])
    assert (plain.members, plain.configs, plain.apply_chat_template, plain.runner) == (["a", "b"], ["all"], False, "inprocess")
    assert plain.out == REPO / "benchmarks" / "runs" / "leaderboard"
    with pytest.raises(SystemExit, match=r"^--preset paper names its own members; drop --members$"):
        leaderboard(["--preset", "paper", "--members", "a"])


def test_subcommands_parse_and_anything_else_is_lm_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench"])  # a benchmark must be named
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "no-such-benchmark"])
    assert exc.value.code == 2
    ran = []
    monkeypatch.setattr(cli, "run_lm_eval", ran.append)
    assert cli.main(["--tasks", "safe_gsm8k", "--model_args", "members=a,b"]) is None
    assert ran == [["--tasks", "safe_gsm8k", "--model_args", "members=a,b"]]
