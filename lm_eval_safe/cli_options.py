"""The options every ``lm-eval-safe`` subcommand shares, declared once: members, drafter,
tasks, the local data folder, the engine and its arguments.

Why one module: the leaderboard and the benchmarks used to declare these in ten parsers, with
two member orders and two ideas of where the data lies (beside the repository, or beside the
current folder). Each subcommand now asks for the options it takes, with its own default where
one differs; the help text, the member order (the README's: ``smollm2-135m,gemma3-270m``,
the first one drafting unless ``--drafter`` says otherwise) and the data folder's lookup are the
same everywhere.

The data folder (the layout of ``../shared/data``: ``gsm8k/``, ``math500/``, ``bbh/``): ``--data-dir``,
else ``$LM_EVAL_SAFE_DATA_DIR`` (the variable the tasks read too), else ``../shared/data``
beside a repository checkout. An installed wheel has no checkout to anchor to, so there it is
the option or the variable, and a command that needs local data stops with a one-line error
saying so.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lm_eval_safe

#: the members of the README's main job, in its order (the first one drafts)
DEFAULT_MEMBERS = "smollm2-135m,gemma3-270m"
#: the environment variable naming the local data folder (the tasks read it as well)
DATA_DIR_ENV = "LM_EVAL_SAFE_DATA_DIR"


def repository_root() -> Path | None:
    """The repository checkout this package runs from (an editable install or ``PYTHONPATH``
    on the clone), or ``None`` for an installed wheel: the folder above the package holding
    ``pyproject.toml`` and ``scripts/``."""
    root = Path(lm_eval_safe.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "scripts").is_dir() else None


def default_data_dir() -> Path | None:
    """Where local data lies when ``--data-dir`` is not given (see the module docstring)."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    root = repository_root()
    return root.parent / "shared" / "data" if root is not None else None


def add_members(parser: argparse.ArgumentParser, default: str | None = DEFAULT_MEMBERS) -> None:
    """``--members``: comma list of member specs (aliases, paths, hub ids)."""
    shown = f" (default: {default})" if default else ""
    parser.add_argument("--members", default=default, help=f"comma list of member specs (aliases, paths){shown}")


def add_drafter(parser: argparse.ArgumentParser, default: str | None = None, help_default: str = "the first member") -> None:
    """``--drafter``: the member that drafts, by name or index."""
    parser.add_argument("--drafter", default=default, help=f"the member that drafts, name or index (default: {help_default})")


def add_tasks(parser: argparse.ArgumentParser, default: str, shown: str | None = None) -> None:
    """``--tasks``: comma list of lm-eval task names or groups (``shown``: the default to
    print where ``default`` is argparse's ``SUPPRESS``)."""
    parser.add_argument("--tasks", default=default, help=f"comma list of tasks or groups (default: {shown or default})")


def add_data_dir(parser: argparse.ArgumentParser, hub: bool = False, aliases: tuple[str, ...] = ()) -> None:
    """``--data-dir``: the local data folder; ``hub``: the commands that can also read the
    tasks' hub datasets accept the word ``hub`` for them; ``aliases``: a command's older
    spelling of the option."""
    hub_note = "; 'hub' (or no local folder): the tasks download their hub datasets" if hub else ""
    parser.add_argument(
        "--data-dir",
        *aliases,
        dest="data_dir",
        default=None,
        help=f"local data folder with the layout of shared/data (default: ${DATA_DIR_ENV}, else "
        f"../shared/data beside a repository checkout){hub_note}",
    )


def add_engine(parser: argparse.ArgumentParser, engine_args_help: str, aliases: tuple[str, ...] = ()) -> None:
    """``--engine`` (the members' engine) and ``--engine-args`` (its own model_args)."""
    from lm_eval_safe.engines.registry import DEFAULT_ENGINE, engine_names

    parser.add_argument("--engine", choices=engine_names(), default=DEFAULT_ENGINE, help="the members' engine")
    parser.add_argument("--engine-args", *aliases, default="", help=engine_args_help)


def split_list(text: str | None) -> list[str]:
    """A comma list's items, blanks dropped."""
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def local_data_dir(given: str | Path | None, command: str) -> Path:
    """The data folder a benchmark reads, which must exist: ``given`` or the default; a
    one-line error naming both ways to give it otherwise."""
    folder = Path(given) if given is not None else default_data_dir()
    if folder is None:
        raise SystemExit(
            f"{command}: no data folder: pass --data-dir DIR or set {DATA_DIR_ENV} "
            "(a folder with the layout of shared/data: gsm8k/, math500/, bbh/)"
        )
    if not folder.is_dir():
        raise SystemExit(f"{command}: data folder {folder} does not exist: pass --data-dir DIR or set {DATA_DIR_ENV}")
    return folder.resolve()


def optional_data_dir(given: str | None) -> Path | None:
    """The leaderboard's data folder: ``hub`` for the hub datasets, a folder given, or the
    default where it exists (else the hub datasets, as lm-eval's tasks do without one)."""
    if given == "hub":
        return None
    if given is not None:
        return Path(given).resolve()
    folder = default_data_dir()
    return folder.resolve() if folder is not None and folder.is_dir() else None


def members_with_drafter_first(members: list[str], drafter: str) -> list[str]:
    """``members`` reordered so the one ``drafter`` names (as ``drafter=`` does: a spec, its
    display name, or an index) comes first: the benchmarks whose runs draft with member 0."""
    from lm_eval_safe.errors import OptionError
    from lm_eval_safe.model_args import resolve_drafter_index

    try:
        index = resolve_drafter_index(drafter, members)
    except OptionError as exc:
        raise SystemExit(f"--drafter: {exc}") from None
    return [members[index], *members[:index], *members[index + 1 :]]
