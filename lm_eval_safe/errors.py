"""The errors a user can fix, each a one-line message saying how; how the command-line entry
points print them (that line alone, unless the traceback is asked for); and the text check
every front door's prompts pass."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable
from functools import wraps
from types import TracebackType
from typing import Any, TypeVar

#: a UTF-16 surrogate code point: JSON's ``"\ud800"`` and Python's ``"\ud800"`` make one, and
#: no UTF-8 text holds one (a pair in JSON decodes to the one character it stands for)
SURROGATE = re.compile("[\ud800-\udfff]")
#: set to 1 to see the traceback of a user error on the command line (as ``--verbosity DEBUG``)
TRACEBACK_ENV = "LM_EVAL_SAFE_TRACEBACK"

F = TypeVar("F", bound=Callable[..., Any])


class UserError(Exception):
    """Base of every error the user can fix from its message alone (an option, a member's name,
    a store, a library version, a request an engine refuses). The command-line entry points
    print such an error as its one line; anything else is a bug or another library's error and
    keeps its traceback. Python callers get the exception as it is."""


class OptionError(UserError, ValueError):
    """A model_args problem the user can fix; the message is one line saying how."""


class RequestError(UserError, ValueError):
    """A request that cannot run, found before any work: one line naming its document."""


def traceback_wanted() -> bool:
    """The user asked for tracebacks: ``LM_EVAL_SAFE_TRACEBACK=1``, or debug logging (lm-eval's
    ``--verbosity DEBUG`` or ``LMEVAL_LOG_LEVEL=DEBUG``, ``lm-eval-safe serve --log-level debug``)."""
    if os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    if _debug_verbosity(sys.argv[1:]):
        return True
    return any(logging.getLogger(name).isEnabledFor(logging.DEBUG) for name in ("lm_eval", "lm_eval_safe"))


def _debug_verbosity(argv: list[str]) -> bool:
    """lm-eval's ``--verbosity DEBUG`` (``-v DEBUG``, ``--verbosity=DEBUG``) on the command line:
    read here because lm-eval 0.4.10+ keeps the flag but no longer applies it to its logger."""
    for at, arg in enumerate(argv):
        if arg in ("--verbosity", "-v") and at + 1 < len(argv):
            value = argv[at + 1]
        elif arg.startswith("--verbosity="):
            value = arg.partition("=")[2]
        else:
            continue
        if value.strip().upper() == "DEBUG":
            return True
    return False


def one_line(prog: str, error: BaseException) -> str:
    """What the terminal shows of a user error: the command's name and the message, on one line
    (a message is written as one line; a stray line break must not make it two)."""
    message = " ".join(str(error).split("\n")).strip() or type(error).__name__
    return f"{prog}: {message}"


def reporting_user_errors(prog: str) -> Callable[[F], F]:
    """Decorate a command's ``main``: a :class:`UserError` leaves it as its one line on stderr
    and exit status 1; with :func:`traceback_wanted`, or for any other exception, Python's
    traceback as usual."""

    def decorate(main: F) -> F:
        @wraps(main)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return main(*args, **kwargs)
            except UserError as exc:
                if traceback_wanted():
                    raise
                sys.exit(one_line(prog, exc))

        return run  # type: ignore[return-value]

    return decorate


def install_excepthook(prog: str) -> None:
    """The same for a command whose ``main`` is not ours to wrap (``python -m lm_eval`` runs
    lm-eval's module as ``__main__``): an uncaught :class:`UserError` is printed as its one
    line (Python exits 1 after any uncaught exception); the others go to the hook before."""
    global _hooked_prog, _previous_hook
    if sys.excepthook is _report_uncaught:
        return
    _hooked_prog, _previous_hook = prog, sys.excepthook
    sys.excepthook = _report_uncaught


_hooked_prog = ""
_previous_hook: Callable[[type[BaseException], BaseException, TracebackType | None], Any] = sys.__excepthook__


def _report_uncaught(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    if isinstance(error, UserError) and not traceback_wanted():
        print(one_line(_hooked_prog, error), file=sys.stderr)
        return
    _previous_hook(kind, error, tb)

def check_text(text: str) -> None:
    """Refuse text holding a lone surrogate, in one line that says so.

    Tokenizers cannot encode it (the fast ones answer ``TextEncodeInput must be Union[...]``,
    which names no cause), and a response echoing it could not be written as UTF-8. Every
    prompt and scored text a member encodes passes here (:meth:`Member.encode`), so
    ``generate_until``, ``loglikelihood`` and the server all refuse it the same way; each adds
    where the text came from (a document, a request field)."""
    found = SURROGATE.search(text)
    if found is None:
        return
    at = found.start()
    around = text[max(0, at - 20) : at + 20]
    raise RequestError(
        f"the text holds a lone UTF-16 surrogate {ascii(found.group())} at character {at} "
        f"(in {ascii(around)}), which is not Unicode text and no tokenizer encodes: send valid "
        "UTF-8 (a surrogate pair as the one character it stands for)"
    )
