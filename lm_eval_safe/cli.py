"""``lm-eval-safe``: the ``lm_eval`` command with this project's tasks on the include path,
``lm-eval-safe report`` (one HTML page over lm-eval output folders), ``lm-eval-safe serve``
(the ensemble behind an OpenAI-compatible server: :mod:`lm_eval_safe.serve`) and
``lm-eval-safe models`` (the members this machine holds: :mod:`lm_eval_safe.members.stores`).

Same arguments as ``lm_eval``; ``--model`` defaults to ``safe-ensemble``. It exists so a user
who cannot rely on the start-up hook (e.g. a read-only site-packages) still has one command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lm_eval_safe.errors import reporting_user_errors


def report(argv: list[str]) -> None:
    """``lm-eval-safe report RESULTS_DIR... --output report.html``."""
    from lm_eval_safe.leaderboard.html_report import write_report
    from lm_eval_safe.leaderboard.runs import RunsError

    parser = argparse.ArgumentParser(
        prog="lm-eval-safe report",
        description="One self-contained HTML page (leaderboard, plots, per-question grid, "
        "responses with their ensemble points) over lm-eval output folders written with "
        "--output_path and --log_samples: members alone (safe-ensemble or hf) and ensembles "
        "(trace=true to see their ensemble points).",
    )
    parser.add_argument("folders", nargs="+", type=Path, help="lm-eval --output_path folders")
    parser.add_argument("--output", type=Path, default=Path("report.html"))
    args = parser.parse_args(argv)
    try:
        path = write_report(args.folders, args.output)
    except RunsError as exc:
        sys.exit(f"lm-eval-safe report: {exc}")
    print(path)


def models(argv: list[str]) -> None:
    """``lm-eval-safe models [--json]``: every member this machine holds, with its name to
    type, size, architecture, quantization and tokenizer (members whose tokenizers differ are
    what SAFE ensembles)."""
    import json

    from lm_eval_safe.members.stores import list_models, store_folders
    from lm_eval_safe.members.stores.files import folder_state

    parser = argparse.ArgumentParser(
        prog="lm-eval-safe models",
        description="The models this machine holds that can be members, with the name to give "
        "in members=: the aliases, Ollama's models, GGUF files in the Hugging Face cache and "
        "in LM Studio's folder. Nothing is downloaded.",
    )
    parser.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    args = parser.parse_args(argv)
    listed = list_models()
    if args.json:
        print(json.dumps([entry.as_dict() for entry in listed], indent=1))
        return
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


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"


@reporting_user_errors("lm-eval-safe")
def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["report"]:
        report(args[1:])
        return
    if args[:1] == ["models"]:
        models(args[1:])
        return
    if args[:1] == ["serve"]:
        from lm_eval_safe.serve.main import main as serve

        serve(args[1:])
        return
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


if __name__ == "__main__":
    main()
