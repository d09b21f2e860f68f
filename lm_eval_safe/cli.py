"""``lm-eval-safe``: one front door.

* ``lm-eval-safe --tasks ... --model_args ...`` (no subcommand): the ``lm_eval`` command with
  ``--model safe-ensemble`` unless given and this project's tasks on the include path. It exists
  so a user who cannot rely on the start-up hook (e.g. a read-only site-packages) still has one
  command; its options are lm_eval's own (``lm_eval -h``).
* ``lm-eval-safe leaderboard``: members alone vs. SAFE and its baselines on the paper's tasks,
  resumable; ``--preset paper --dry-run`` prints the paper's Table 2 as lm_eval commands
  (:mod:`lm_eval_safe.leaderboard.cli`).
* ``lm-eval-safe bench NAME``: the benchmarks (eval, speed, batch, host, serve, scoring,
  sampling, memory, llama-cpp, conformance: :mod:`lm_eval_safe.bench.commands`).
* ``lm-eval-safe report``: one HTML page over lm-eval output folders.
* ``lm-eval-safe models``: the members this machine holds (:mod:`lm_eval_safe.members.stores`).
* ``lm-eval-safe serve``: the ensemble behind an OpenAI-compatible server
  (:mod:`lm_eval_safe.serve`).

The subcommands are argparse subparsers; the options several share (members, tasks, data
folder, engine) are declared once, in :mod:`lm_eval_safe.cli_options`. Only the subcommand
typed is built (its module imported), so ``lm-eval-safe models`` never loads torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lm_eval_safe.errors import reporting_user_errors

#: the subcommands and their one line of help; anything else first runs lm_eval
SUBCOMMANDS = {
    "leaderboard": "members alone vs. SAFE and baseline ensembles on lm-eval tasks (--preset paper)",
    "bench": "the benchmarks: lm-eval-safe bench NAME (eval, speed, batch, host, ...)",
    "report": "one HTML page over lm-eval output folders",
    "models": "the models this machine holds that can be members",
    "serve": "the ensemble behind an OpenAI-compatible server",
}
REPORT_DESCRIPTION = (
    "One self-contained HTML page (leaderboard, plots, per-question grid, responses with their "
    "ensemble points) over lm-eval output folders written with --output_path and --log_samples: "
    "members alone (safe-ensemble or hf) and ensembles (trace=true to see their ensemble points)."
)
MODELS_DESCRIPTION = (
    "The models this machine holds that can be members, with the name to give in members=: the "
    "aliases, Ollama's models, GGUF files in the Hugging Face cache and in LM Studio's folder. "
    "Nothing is downloaded."
)
#: what the parsers add to the namespace to route it, dropped before a command sees it
ROUTING = ("command", "bench_command", "run")


def configure_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folders", nargs="+", type=Path, help="lm-eval --output_path folders")
    parser.add_argument("--output", type=Path, default=Path("report.html"))


def run_report(args: argparse.Namespace) -> int:
    """``lm-eval-safe report RESULTS_DIR... --output report.html``."""
    from lm_eval_safe.leaderboard.html_report import write_report
    from lm_eval_safe.leaderboard.runs import RunsError

    try:
        path = write_report(args.folders, args.output)
    except RunsError as exc:
        sys.exit(f"lm-eval-safe report: {exc}")
    print(path)
    return 0


def configure_models(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON list instead of a table")


def run_models(args: argparse.Namespace) -> int:
    """``lm-eval-safe models [--json]``: every member this machine holds, with its name to
    type, size, architecture, quantization and tokenizer (members whose tokenizers differ are
    what SAFE ensembles)."""
    import json

    from lm_eval_safe.members.stores import list_models, store_folders
    from lm_eval_safe.members.stores.files import folder_state

    listed = list_models()
    if args.json:
        print(json.dumps([entry.as_dict() for entry in listed], indent=1))
        return 0
    rows = [("NAME", "SIZE", "ARCH", "QUANT", "TOKENIZER")]
    rows += [
        (e.name, _size(e.size), e.architecture or "-", e.quantization or "-", e.tokenizer or e.note or "-")
        for e in listed
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)), row[4]]).rstrip())
    folders = {store: folder_state(path) for store, path in store_folders().items()}
    print(
        f"\nlooked in: Ollama {folders['ollama']}, Hugging Face cache {folders['hub']}, "
        f"LM Studio {folders['lmstudio']}\n"
        'members of different TOKENIZER ensemble across tokenizers: --model_args "members=NAME,NAME"'
    )
    return 0


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"


def report(argv: list[str]) -> int:
    """``lm-eval-safe report`` with a plain argument list."""
    return main(["report", *argv])


def models(argv: list[str]) -> int:
    """``lm-eval-safe models`` with a plain argument list."""
    return main(["models", *argv])


def _subcommand(name: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Any], str] | None:
    """How to build and run subcommand ``name`` (its module imported here, only when typed):
    the parser's options, the runner and the description; ``None`` for ``bench`` (a level of
    its own)."""
    if name == "leaderboard":
        from lm_eval_safe.leaderboard import cli as leaderboard

        return leaderboard.configure, leaderboard.run, leaderboard.DESCRIPTION
    if name == "serve":
        from lm_eval_safe.serve import main as serve

        return serve.configure, serve.run, serve.DESCRIPTION
    if name == "report":
        return configure_report, run_report, REPORT_DESCRIPTION
    if name == "models":
        return configure_models, run_models, MODELS_DESCRIPTION
    return None


def _add_bench(parser: argparse.ArgumentParser, typed: Sequence[str]) -> None:
    """``lm-eval-safe bench NAME``: one subparser per benchmark, the typed one built."""
    from lm_eval_safe.bench import commands

    benches = parser.add_subparsers(dest="bench_command", metavar="NAME", required=True)
    for name, (_module, help_line) in commands.COMMANDS.items():
        if typed[:1] != [name]:
            benches.add_parser(name, help=help_line)
            continue
        module = commands.load(name)
        bench = benches.add_parser(
            name,
            help=help_line,
            description=commands.description(module),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.configure(bench)
        bench.set_defaults(run=module.run)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """``lm-eval-safe``'s parser, with the subcommand ``argv`` names built in full (the others
    listed with their help line only)."""
    parser = argparse.ArgumentParser(
        prog="lm-eval-safe",
        description="SAFE ensembles in lm-evaluation-harness. Without a subcommand: lm_eval with "
        "--model safe-ensemble and this project's tasks (lm-eval-safe --tasks ... --model_args "
        "members=a,b; lm_eval -h lists its options).",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_line in SUBCOMMANDS.items():
        if list(argv[:1]) != [name]:
            subcommands.add_parser(name, help=help_line)
            continue
        built = _subcommand(name)
        if built is None:
            _add_bench(subcommands.add_parser(name, help=help_line, description=help_line), argv[1:])
            continue
        configure, run, description = built
        sub = subcommands.add_parser(name, help=help_line, description=description)
        configure(sub)
        sub.set_defaults(run=run)
    return parser


def run_lm_eval(args: list[str]) -> None:
    """The bare form: lm_eval's own command line, with this backend and its tasks."""
    import lm_eval_safe
    from lm_eval_safe._autoregister import install

    install()
    if (
        not any(a == "--model" or a.startswith("--model=") for a in args)
        and "-h" not in args
        and "--help" not in args
    ):
        args = ["--model", lm_eval_safe.MODEL_NAME, *args]
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args = [*args, "--include_path", lm_eval_safe.task_dir()]
    sys.argv = ["lm-eval-safe", *args]
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


@reporting_user_errors("lm-eval-safe")
def main(argv: list[str] | None = None) -> int | None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] not in SUBCOMMANDS and args[0] not in ("-h", "--help")):
        run_lm_eval(args)
        return None
    run, parsed = parse(args)
    return run(parsed)


def parse(argv: Sequence[str]) -> tuple[Callable[[argparse.Namespace], Any], argparse.Namespace]:
    """A subcommand's runner and its options, without what routed them (a command sees its
    own options only: some write them into their reports)."""
    parsed = build_parser(argv).parse_args(argv)
    run = parsed.run
    for key in ROUTING:
        vars(parsed).pop(key, None)
    return run, parsed


if __name__ == "__main__":
    sys.exit(main())
