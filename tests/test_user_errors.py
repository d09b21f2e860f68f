"""Errors as the commands print them, in real processes: this package's user errors (options,
members, stores, versions) are one line on stderr and a non-zero exit from ``lm_eval`` (the
start-up hook), ``lm-eval-safe`` and ``lm-eval-safe serve``; the traceback comes back with
``LM_EVAL_SAFE_TRACEBACK=1`` or debug logging; any other exception keeps its traceback; Python
callers get the exception itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lm_eval_safe.errors import (
    TRACEBACK_ENV,
    OptionError,
    RequestError,
    UserError,
    reporting_user_errors,
)

pytestmark = pytest.mark.slow  # whole processes and end-to-end runs: the slow tier

DRAFT_LEN = "draft_len=0 must be at least 1 (or auto)"
COLLISION = (
    "members 'smollm2-135m' and 'ollama:smollm2:135m' would both be called 'smollm2-135m' (in results, "
    "traces, run folders and drafter=): list each model once, or give one as a file or folder of another name"
)
EXE = Path(sys.executable).parent


def run(argv: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``argv`` in a fresh process, offline, lm-eval's own log lines off (they are lm-eval's, not
    the error's), Ollama's store an empty folder of the test's."""
    (tmp_path / "ollama").mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k != TRACEBACK_ENV}
    full = {**base, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "LMEVAL_LOG_LEVEL": "ERROR",
            "OLLAMA_MODELS": str(tmp_path / "ollama"), **env}  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env=full, cwd=tmp_path, timeout=300)


def lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def assert_one_line(proc: subprocess.CompletedProcess[str], expected: str) -> None:
    assert proc.returncode != 0
    assert lines(proc) == [expected], proc.stderr[-3000:]


NOSUCH = "member 'ollama:nosuch': Ollama's store {} has no nosuch:latest (it has: nothing); run `ollama pull nosuch`"


@pytest.mark.parametrize(
    ("argv", "members", "expected"),
    [
        ([sys.executable, "-m", "lm_eval", "--model", "safe-ensemble"], "gemma3-270m,draft_len=0", f"lm_eval: {DRAFT_LEN}"),
        ([str(EXE / "lm_eval"), "--model", "safe-ensemble"], "ollama:nosuch", f"lm_eval: {NOSUCH}"),
        ([str(EXE / "lm-eval-safe")], "gemma3-270m,draft_len=0", f"lm-eval-safe: {DRAFT_LEN}"),
    ],
    ids=["python -m lm_eval", "lm_eval", "lm-eval-safe"],
)
def test_a_user_error_is_one_line(argv: list[str], members: str, expected: str, tmp_path: Path) -> None:
    """Both ways lm-eval's command starts (its console script imports its module, ``python -m``
    runs it as ``__main__``) and this package's command."""
    # lm-eval's own INFO lines off (0.4.9 reads --verbosity, 0.4.10+ LMEVAL_LOG_LEVEL): one line left
    args = ["--model_args", f"members=smollm2-135m,{members}", "--tasks", "gsm8k", "--verbosity", "ERROR"]
    assert_one_line(run([*argv, *args], tmp_path), expected.format(tmp_path / "ollama"))


def test_the_traceback_with_verbosity_debug(tmp_path: Path) -> None:
    proc = run([sys.executable, "-m", "lm_eval", "--model", "safe-ensemble", "--tasks", "gsm8k", "--model_args",
                "members=smollm2-135m,gemma3-270m,draft_len=0", "--verbosity", "DEBUG"], tmp_path)  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback (most recent call last):" in proc.stderr
    assert lines(proc)[-1] == f"lm_eval_safe.errors.OptionError: {DRAFT_LEN}"


def test_serve_start_up_errors_are_one_line(tmp_path: Path) -> None:
    """A bad member, and an untested library version (a transformers 4.46.3 installation's
    metadata found first on the path, as pip would leave it)."""
    serve = [str(EXE / "lm-eval-safe"), "serve", "--log-level", "warning", "--model_args"]
    proc = run([*serve, "members=smollm2-135m,ollama:smollm2:135m"], tmp_path)
    assert_one_line(proc, f"lm-eval-safe serve: {COLLISION}")
    proc = run([*serve, "members=smollm2-135m,ollama:smollm2:135m"], tmp_path, **{TRACEBACK_ENV: "1"})
    assert proc.returncode != 0 and "Traceback (most recent call last):" in proc.stderr
    assert lines(proc)[-1] == f"lm_eval_safe.errors.OptionError: {COLLISION}"
    fake = tmp_path / "old" / "transformers-4.46.3.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.46.3\n")
    path = os.pathsep.join([str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = run([*serve, "members=smollm2-135m,gemma3-270m"], tmp_path, PYTHONPATH=path, LM_EVAL_SAFE_ALLOW_UNTESTED_VERSIONS="")
    assert_one_line(proc, (
        "lm-eval-safe serve: safe-ensemble: transformers 4.46.3 is untested (tested: >=4.57.1,<4.58, "
        ">=5.0.0,<5.25): pip install 'transformers>=4.57.1,<5.25' (or set "
        "LM_EVAL_SAFE_ALLOW_UNTESTED_VERSIONS=1 to run untested, at your own risk)"
    ))  # fmt: skip


@pytest.mark.parametrize(
    ("raised", "last"),
    [("OptionError('bad option')", None), ("RuntimeError('a bug')", "RuntimeError: a bug"), ("KeyError('x')", "KeyError: 'x'")],
)
def test_only_the_packages_user_errors_lose_their_traceback(raised: str, last: str | None, tmp_path: Path) -> None:
    """Once lm-eval's command module is loaded, an uncaught error of this package's is its line;
    a bug or another library's error prints Python's traceback as ever."""
    code = f"import lm_eval.__main__\nfrom lm_eval_safe.errors import OptionError\nraise {raised}\n"
    proc = run([sys.executable, "-c", code], tmp_path)
    assert proc.returncode == 1
    if last is None:
        assert lines(proc) == ["lm_eval: bad option"], proc.stderr
    else:
        assert lines(proc)[0] == "Traceback (most recent call last):" and lines(proc)[-1] == last, proc.stderr


def test_python_callers_get_the_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-line report lives in the commands: a wrapped function called from Python with the
    traceback switch on raises, and ``simple_evaluate`` raises the error itself."""
    from lm_eval import simple_evaluate

    with pytest.raises(OptionError, match=r"^draft_len=0 must be at least 1 \(or auto\)$"):
        simple_evaluate(model="safe-ensemble", model_args="members=smollm2-135m,gemma3-270m,draft_len=0", tasks=["gsm8k"])

    @reporting_user_errors("prog")
    def fails() -> None:
        raise RequestError("a request\nover two lines")

    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(SystemExit) as exited:
        fails()
    assert exited.value.code == "prog: a request over two lines"
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(RequestError):
        fails()


def test_every_user_error_shares_the_base() -> None:
    from lm_eval_safe.engines.hf.kv_cache import UnsupportedModelError
    from lm_eval_safe.engines.scoring import ScoringError
    from lm_eval_safe.leaderboard.runs import RunsError
    from lm_eval_safe.members.gguf_info import GGUFFormatError
    from lm_eval_safe.versions import VersionError

    for kind in (OptionError, RequestError, VersionError, ScoringError, UnsupportedModelError, GGUFFormatError, RunsError):
        assert issubclass(kind, UserError), kind
