"""The symbolic checker's worker process: one JSON request per line on stdin, one reply per
line on stdout.

:class:`~lm_eval_safe.answer_checking.symbolic.SymbolicChecker` starts this file BY PATH (not
as ``lm_eval_safe.answer_checking.symbolic_worker``), so that the worker imports neither the
package nor torch: it must need nothing but the standard library at import time, and import
nothing of this project. sympy, latex2sympy2 and math-verify are imported here, in the
worker, where a runaway computation can be killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any


def _latex_to_sympy(latex: str) -> Any:
    """LaTeX -> sympy with latex2sympy2_extended, else sympy's own (antlr) parser."""
    try:
        from latex2sympy2_extended import latex2sympy
    except ImportError:
        from sympy.parsing.latex import parse_latex

        return parse_latex(latex)
    return latex2sympy(latex)


def _worker_compare(gold: str, pred: str) -> bool:
    """Symbolic equality, run *inside the worker process* only.

    math-verify first when installed (it handles sets, intervals, tuples,
    matrices, percent, text answers), then LaTeX -> sympy and simplification of
    the difference as a fallback for plain expressions.  Each stage is optional:
    a missing library or a parse failure just means "not shown equal".
    """
    try:
        from math_verify import parse, verify

        g = parse("\\boxed{" + gold + "}")
        p = parse("\\boxed{" + pred + "}")
        if g and p and verify(g, p):
            return True
    except Exception:  # noqa: BLE001 - includes ImportError when not installed
        pass
    try:
        import sympy

        a = _latex_to_sympy(gold)
        b = _latex_to_sympy(pred)
        if isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr):
            if a == b:
                return True
            diff = sympy.simplify(a - b)
            if diff == 0:
                return True
            if diff.is_number and abs(complex(sympy.N(diff))) < 1e-9:
                return True
    except Exception:  # noqa: BLE001
        pass
    return False


def main() -> None:
    """Loop of the worker process: one JSON request per line on stdin.

    A watchdog thread exits the worker if its parent dies, so a worker stuck in
    a long computation never outlives the run.
    """
    parent = os.getppid()

    def _watchdog() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=_watchdog, daemon=True).start()
    try:  # cap memory so a runaway expression raises MemoryError, not OOM
        import resource

        limit = 4 * 1024**3
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except Exception:  # noqa: BLE001 - best effort only
        pass
    # warm the (optional) imports before reporting "ready"
    for name in ("sympy", "latex2sympy2_extended", "math_verify"):
        with contextlib.suppress(ImportError):
            __import__(name)

    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            eq = _worker_compare(str(req["gold"]), str(req["pred"]))
        except Exception:  # noqa: BLE001
            eq = False
        out.write(json.dumps({"eq": bool(eq)}) + "\n")
        out.flush()
