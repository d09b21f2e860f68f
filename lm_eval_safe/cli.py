"""``lm-eval-safe``: the ``lm_eval`` command with this project's tasks on the include path.

Same arguments as ``lm_eval``; ``--model`` defaults to ``safe-ensemble``. It exists so a user
who cannot rely on the start-up hook (e.g. a read-only site-packages) still has one command.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    import lm_eval_safe
    from lm_eval_safe._autoregister import install

    install()
    args = list(sys.argv[1:] if argv is None else argv)
    if (
        not any(a == "--model" or a.startswith("--model=") for a in args)
        and "-h" not in args
        and "--help" not in args
    ):
        args = ["--model", "safe-ensemble", *args]
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args = [*args, "--include_path", lm_eval_safe.task_dir()]
    sys.argv = ["lm-eval-safe", *args]
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
