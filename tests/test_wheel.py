"""The wheel carries the front door: built from this checkout, installed outside it, its own
``lm-eval-safe leaderboard --preset paper --dry-run`` prints the paper's Table 2 as lm_eval
commands, run from a folder outside the clone.

Why: ``pip install`` users get only what ``pyproject.toml`` packages. The leaderboard and the
benchmarks used to be ``scripts/``, which no wheel carries, and their defaults were anchored to
the repository. Here nothing of the clone is on the path: the wheel is installed with ``pip
install --target`` into a temporary folder that ``PYTHONPATH`` puts first (a venv with
``--system-site-packages`` would let the editable install shadow it), the imported modules must
lie there, and the commands printed are checked against the paper's pairs and configurations
(:mod:`lm_eval_safe.leaderboard.configs`) and against the command lines this checkout's
leaderboard builds for the same settings.

Building needs hatchling in this Python (``pip install 'lm-eval-safe[test]'``, which
``scripts/setup.sh`` installs): the build runs without isolation, so it never reaches the
network. Without hatchling the test skips, unless ``LM_EVAL_SAFE_REQUIRE_WHEEL_BUILD=1`` (CI)
makes that a failure.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import parse_lm_eval_command

REPO = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip"]


@pytest.fixture(scope="module")
def installed() -> Iterator[Path]:
    """A temporary folder outside the clone holding the wheel built from it, installed."""
    if importlib.util.find_spec("hatchling") is None:
        missing = "hatchling (the wheel's build backend) is not installed: pip install 'lm-eval-safe[test]'"
        if os.environ.get("LM_EVAL_SAFE_REQUIRE_WHEEL_BUILD") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    with tempfile.TemporaryDirectory(prefix="lm-eval-safe-wheel-") as folder:
        root = Path(folder)
        assert not root.is_relative_to(REPO)
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
        build = [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"), str(REPO)]
        subprocess.run(build, check=True, env=env, capture_output=True, timeout=300)
        (wheel,) = (root / "dist").glob("lm_eval_safe-*.whl")
        target = root / "site"
        install = [*PIP, "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)]
        subprocess.run(install, check=True, env=env, capture_output=True, timeout=300)
        yield target


def wheel_env(target: Path) -> dict[str, str]:
    """The installed wheel first on the path, and nothing pointing at the clone's data."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LM_EVAL_SAFE_DATA_DIR")}
    return {**env, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}


def test_the_wheel_prints_the_papers_commands_outside_the_clone(
    installed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lm_eval_safe.leaderboard import cli as clone_leaderboard
    from lm_eval_safe.leaderboard.configs import (
        PAPER_PAIRS,
        PAPER_PRESET,
        PAPER_SETTINGS,
        PAPER_TASKS,
    )
    from lm_eval_safe.options import parse_options

    with tempfile.TemporaryDirectory(prefix="lm-eval-safe-cwd-") as folder:
        cwd = Path(folder).resolve()
        env = wheel_env(installed)
        where = subprocess.run(
            [sys.executable, "-c", "import importlib.util as u, lm_eval_safe.leaderboard.cli as m, lm_eval_safe.cli_options as o\n"
             "from lm_eval_safe.bench.commands import COMMANDS\n"
             "print(o.repository_root()); print(m.__file__)\n"
             "for module, _ in COMMANDS.values(): print(u.find_spec(f'lm_eval_safe.bench.commands.{module}').origin)"],
            cwd=cwd, env=env, capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        root, *module_files = where.stdout.split()
        assert root == "None", "an installed wheel has no repository checkout"
        assert len(module_files) == 1 + 11, "the leaderboard and the eleven benchmarks"
        for module_file in module_files:
            assert Path(module_file).is_relative_to(installed), f"the wheel's code runs, not {module_file}"
        assert (installed / "lm_eval_safe" / "bench" / "authors_runner.py").is_file(), "bench conformance's runner"

        command = [str(installed / "bin" / "lm-eval-safe"), "leaderboard", "--preset", "paper", "--dry-run"]
        proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = proc.stdout.splitlines()
        out = cwd / "benchmarks" / "runs" / "paper"  # no checkout: the default under the current folder
        assert not out.exists(), "a dry run writes nothing"

        commands = [line for line in printed if line.startswith("lm_eval ")]
        assert all(line.startswith(("lm_eval ", "# ")) for line in printed if line)
        # members alone (Qwen2.5 in both pairs, run once) and 4 ensembles per pair, on each task
        members = {m for pair in PAPER_PAIRS for m in pair.members}
        ensembles = PAPER_PRESET["configs"].split(",")[1:]
        assert len(commands) == (len(members) + len(PAPER_PAIRS) * len(ensembles)) * len(PAPER_TASKS)
        seen = set()
        for line in commands:
            args = parse_lm_eval_command(shlex.split(line))
            assert args["model"] == "safe-ensemble" and args["apply_chat_template"] is True
            assert args["gen_kwargs"] == {"max_gen_toks": PAPER_SETTINGS["max_gen_toks"]}
            assert args["include_path"] == str(installed / "lm_eval_safe" / "tasks")
            assert Path(args["output_path"]).is_relative_to(out) and "--metadata" not in line  # the hub's data
            seen.add((tuple(parse_options(args["model_args"]).members), args["tasks"][0]))
        rows = {(m,) for m in members} | {tuple(pair.members) for pair in PAPER_PAIRS}
        assert seen == {(r, t) for r in rows for t in PAPER_TASKS}

        # the same command lines this checkout's leaderboard builds for the same folders
        clone_leaderboard.main(["--preset", "paper", "--dry-run", "--out", str(out), "--data-dir", "hub"])
        clone_tasks = str(REPO / "tasks")
        expected = [
            line.replace(shlex.quote(clone_tasks), shlex.quote(str(installed / "lm_eval_safe" / "tasks")))
            for line in capsys.readouterr().out.splitlines()
            if line.startswith("lm_eval ")
        ]
        assert commands == expected
