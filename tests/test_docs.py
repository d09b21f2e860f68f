"""The documentation's commands run as pasted.

Every ```bash block of README.md and docs/*.md must be valid bash (``bash -n``), and every
command in it that this project or lm-eval parses must get past that parser: ``lm_eval ...``
(lm-eval's own CLI parser, as tests/helpers.py's ``parse_lm_eval_command`` runs it, with
``--model_args`` through the backend's ``parse_model_args`` and, for ``safe-ensemble``, its
option validation), ``lm-eval-safe ...`` (its subcommands through its own parser, and the lm_eval form),
``python scripts/X.py ...`` (the script's own argparse parser) and ``bash scripts/setup.sh``.
A word that bash would run as a program must be one the docs are expected to use, so an
unquoted ``|`` inside a list (``tensor_parallel_size=2|1``) fails: bash reads it as a pipe
into a program named ``1,...``. ```python blocks must compile. Relative links must point at
files and headings that exist, and the README stays short. Nothing here loads a model or
touches the network.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WITH_COMMANDS = [*DOCS, ROOT / "BENCHMARKS.md"]  # pages whose commands must run as pasted
README_MAX_LINES = 300
PAGE_MAX_LINES = 450

# programs the docs may run besides the ones parsed below (basename of the first word)
OTHER_PROGRAMS = {
    "accelerate", "apt-get", "cat", "cd", "curl", "echo", "export", "git", "inspect", "kill",
    "ls", "nvidia-smi", "pip", "pytest", "ruff", "sleep", "source", "wait",
}  # fmt: skip
PYTHONS = {"python", "python3"}
SEPARATORS = {";", "&&", "||", "|", "&", "|&"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Command:
    block: Block
    argv: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.block.where}: {shlex.join(self.argv)[:120]}"


def code_blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced code blocks of a markdown file, with the line of their opening fence."""
    text = path.read_text() if text is None else text
    blocks = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(path, line, match.group(1), match.group(2)))
    return blocks


def all_blocks(language: str) -> list[Block]:
    return [b for path in WITH_COMMANDS for b in code_blocks(path) if b.language == language]


def shell_words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    return list(lexer)


def commands(block: Block) -> Iterator[Command]:
    """The simple commands of a bash block, as bash would split them: continuations joined,
    comments dropped, ``;``/``&&``/``|``/``&`` separating commands, redirections and leading
    ``NAME=value`` assignments removed, and the block's own variables (``M=...`` on a line of
    its own) substituted."""
    variables: dict[str, str] = {}
    text = block.text.replace("\\\n", " ")
    for line in text.splitlines():
        for name, value in variables.items():
            line = re.sub(rf"\$(\{{{name}\}}|{name}\b)", lambda _m, v=value: v, line)
        words = shell_words(line)
        current: list[str] = []
        skip_next = False
        for word in [*words, ";"]:
            if skip_next:
                skip_next = False
                continue
            if word in SEPARATORS:
                assignments = [w for w in current if re.fullmatch(r"[A-Za-z_]\w*=.*", w)]
                if current and len(assignments) == len(current):
                    variables.update(w.split("=", 1) for w in assignments)  # type: ignore[misc]
                while current and re.fullmatch(r"[A-Za-z_]\w*=.*", current[0]):
                    current.pop(0)
                if current:
                    yield Command(block, tuple(current))
                current = []
            elif set(word) <= set("<>&|") and ("<" in word or ">" in word):
                if current and current[-1].isdigit():
                    current.pop()  # the 2 of 2>&1
                skip_next = not word.endswith("&")
            else:
                current.append(word)


def all_commands() -> list[Command]:
    return [c for block in all_blocks("bash") for c in commands(block)]


# --- parsers -------------------------------------------------------------------------------


class Parsed(Exception):
    """Raised from inside a script's argparse call once its command line has parsed."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


@contextlib.contextmanager
def stop_after_parsing(argv0: str, argv: list[str]) -> Iterator[io.StringIO]:
    """Run a command line up to its first ``ArgumentParser.parse_args`` and stop there, with
    argparse's own error message (if any) captured."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise Parsed(original(self, args, namespace))

    err = io.StringIO()
    old_argv = sys.argv
    sys.argv = [argv0, *argv]
    argparse.ArgumentParser.parse_args = parse_and_stop  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            yield err
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv = old_argv


def check_parses(run: Any, argv0: str, argv: list[str]) -> argparse.Namespace:
    """``run()`` must reach an argparse parse of ``argv`` that succeeds."""
    try:
        with stop_after_parsing(argv0, argv) as err:
            run()
    except Parsed as done:
        return done.namespace
    except SystemExit as exc:
        raise AssertionError(f"{argv0} refuses its arguments ({exc.code}): {err.getvalue().strip()}") from None
    raise AssertionError(f"{argv0} returned without parsing its arguments")


def check_safe_ensemble_args(model_args: Any) -> None:
    """``--model_args`` of a safe-ensemble command: parsed and validated as the model would,
    before it loads anything (unknown keys and bad values fail)."""
    from lm_eval_safe.errors import OptionError
    from lm_eval_safe.model_args import parse_model_args
    from lm_eval_safe.options import parse_options

    try:
        parse_options(parse_model_args(model_args))
    except OptionError as exc:
        raise AssertionError(f"--model_args {model_args!r}: {exc}") from None


def check_lm_eval(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from helpers import parse_lm_eval_command
    finally:
        sys.path.remove(str(ROOT / "tests"))

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parse_lm_eval_command(["lm_eval", *argv])
    except SystemExit as exc:
        raise AssertionError(f"lm_eval refuses its arguments ({exc.code}): {err.getvalue().strip()}") from None
    assert args["tasks"], "lm_eval runs nothing without --tasks"
    if args["model"] == "safe-ensemble":
        check_safe_ensemble_args(args["model_args"])
    for task in args["tasks"]:
        if task.startswith("safe_"):
            assert task in task_names(), f"no task {task!r} in tasks/"


def task_names() -> set[str]:
    names = set()
    for path in (ROOT / "tasks").rglob("*.yaml"):
        names.update(re.findall(r"^(?:task|group): *(\S+)", path.read_text(), flags=re.M))
    return names


def check_lm_eval_safe(argv: list[str]) -> str:
    """A subcommand through ``lm-eval-safe``'s own parser (``serve``'s model_args validated
    as well); anything else as the lm_eval command it becomes. Returns what checked it."""
    from lm_eval_safe import cli

    if argv[:1] and argv[0] in cli.SUBCOMMANDS:
        args = check_parses(lambda: cli.main(argv), "lm-eval-safe", argv)
        if argv[0] == "serve":
            check_safe_ensemble_args(args.model_args)
        return f"lm-eval-safe {argv[0]}"
    # lm_eval with --model safe-ensemble unless given, and this project's tasks
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        argv = ["--model", "safe-ensemble", *argv]
    check_lm_eval(argv)
    return "lm-eval-safe"


def check_script(script: str, argv: list[str]) -> None:
    path = ROOT / script
    assert path.is_file(), f"no script {script}"
    sys.path.insert(0, str(path.parent))
    try:
        args = check_parses(lambda: runpy.run_path(str(path), run_name="__main__"), script, argv)
    finally:
        sys.path.remove(str(path.parent))
    model_args = getattr(args, "model_args", None)
    if isinstance(model_args, str) and model_args:
        check_safe_ensemble_args(model_args)


def check_setup(argv: list[str]) -> None:
    known = set(re.findall(r"^\s+(--[\w-]+)\)", (ROOT / "scripts/setup.sh").read_text(), flags=re.M))
    flags = [a for a in argv if a.startswith("-")]
    assert set(flags) <= known, f"setup.sh has no {sorted(set(flags) - known)} (known: {sorted(known)})"


def check_command(argv: tuple[str, ...]) -> str:
    """Check one command; return what checked it."""
    words = list(argv)
    program = Path(words[0]).name
    if program in ("lm_eval", "lm-eval"):
        check_lm_eval(words[1:])
        return "lm_eval"
    if program == "lm-eval-safe":
        return check_lm_eval_safe(words[1:])
    if program in PYTHONS or program in ("torchrun",):
        if "-m" in words:
            module, rest = words[words.index("-m") + 1], words[words.index("-m") + 2 :]
            if module == "lm_eval":
                check_lm_eval(rest)
                return "lm_eval"
            assert module in ("pytest", "json.tool", "pip"), f"unexpected module {module}"
            return module
        scripts = [w for w in words[1:] if w.endswith(".py")]
        assert program in PYTHONS and scripts, f"{program} runs neither a module nor a script"
        index = words.index(scripts[0])
        check_script(scripts[0], words[index + 1 :])
        return "script"
    if program == "bash":
        assert words[1:2] == ["scripts/setup.sh"], f"bash runs {words[1:2]}, not scripts/setup.sh"
        check_setup(words[2:])
        return "setup.sh"
    if program == "accelerate" and "-m" in words:
        return check_command(("python", *words[words.index("-m") :]))
    assert program in OTHER_PROGRAMS, (
        f"{program!r} is no program the docs use: an unquoted | ; & or a stray word? "
        f"(quote per-member lists: --model_args \"members=a,b,weights=2|1\")"
    )
    return program


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("block", all_blocks("bash"), ids=lambda b: b.where)
def test_bash_blocks_are_valid_bash(block: Block) -> None:
    proc = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    assert proc.returncode == 0, f"{block.where}: {proc.stderr}"


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: c.where)
def test_commands_parse(command: Command) -> None:
    try:
        check_command(command.argv)
    except AssertionError as exc:
        raise AssertionError(f"{command.where}\n{exc}") from None


@pytest.mark.parametrize("block", all_blocks("python"), ids=lambda b: b.where)
def test_python_blocks_compile(block: Block) -> None:
    compile(block.text, block.where, "exec")


def test_the_docs_show_the_main_commands() -> None:
    """The checks above see the commands they are meant for."""
    checked = [check_command(c.argv) for c in all_commands()]
    kinds = ("lm_eval", "lm-eval-safe", "lm-eval-safe leaderboard", "lm-eval-safe bench", "lm-eval-safe serve")
    for kind in (*kinds, "script", "setup.sh", "pytest"):
        assert kind in checked, kind


@pytest.mark.parametrize(
    "bad",
    [
        # bash reads the | as a pipe into a program named "1,gpu_memory_utilization=0.5"
        "lm_eval --model safe-ensemble --model_args members=a,b,engine=vllm,tensor_parallel_size=2|1,gpu_memory_utilization=0.5 --tasks safe_gsm8k",
        "lm_eval --model safe-ensemble --model_args members=a,b --tasks safe_gsm8k --no-such-flag",
        "lm_eval --model safe-ensemble --model_args members=a,b,no_such_option=1 --tasks safe_gsm8k",
        "lm_eval --model safe-ensemble --model_args members=a,b --tasks safe_no_such_task",
        "lm-eval-safe serve --model_args members=a,b --no-such-flag",
        "lm-eval-safe report results --no-such-flag",
        "python scripts/bench_speed.py --no-such-flag",
        "lm-eval-safe bench speed --no-such-flag",
        "lm-eval-safe bench no-such-benchmark",
        "lm-eval-safe leaderboard --preset no-such-preset",
        "python scripts/no_such_script.py",
        "bash scripts/setup.sh --no-such-flag",
        "lm_eval --model safe-ensemble --model_args members=a,b ...",
    ],
)
def test_a_broken_command_fails(bad: str) -> None:
    block = Block(ROOT / "README.md", 1, "bash", bad + "\n")
    with pytest.raises(AssertionError):
        for command in commands(block):
            check_command(command.argv)


def test_quoted_lists_and_variables_are_read_as_bash_reads_them() -> None:
    text = (
        'M=drafter,safe_unite\nHF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_speed.py --methods $M \\\n'
        '    --max-new-tokens 8  # a comment\n'
        'lm-eval-safe serve --model_args "members=a,b,weights=2|1" --port 8000 &\n'
    )
    found = [c.argv for c in commands(Block(ROOT / "README.md", 1, "bash", text))]
    assert found == [
        (".venv/bin/python", "scripts/bench_speed.py", "--methods", "drafter,safe_unite", "--max-new-tokens", "8"),
        ("lm-eval-safe", "serve", "--model_args", "members=a,b,weights=2|1", "--port", "8000"),
    ]
    for argv in found:
        check_command(argv)


def github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("path", WITH_COMMANDS, ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name}: link to missing {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{path.name}: no heading #{anchor} in {linked.name}"


def test_pages_stay_short() -> None:
    lengths = {p.name: len(p.read_text().splitlines()) for p in DOCS}
    assert lengths["README.md"] <= README_MAX_LINES, lengths
    assert max(lengths.values()) <= PAGE_MAX_LINES, lengths


def test_no_development_machine_paths() -> None:
    """Docs and the raw benchmark files name paths relative to the repository (or ~)."""
    files = [*WITH_COMMANDS, *(p for p in (ROOT / "benchmarks").rglob("*") if p.is_file())]
    pattern = re.compile(r"(?<![\w.~])/(?:work|tmp|root|home)/")
    for path in files:
        if path.suffix in (".png", ".jpg") or "runs" in path.relative_to(ROOT).parts:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            assert not pattern.search(line), f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"

