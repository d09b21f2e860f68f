"""Answer extraction and equivalence checking for the SAFE benchmark tasks.

The task configs in ``tasks/`` (``safe_math500``, ``safe_gsm8k``, ``safe_bbh``) score
generations with the functions re-exported here, one module per benchmark:
:mod:`.math_answers` (MATH extraction and normalisation), :mod:`.symbolic` (symbolic
equivalence in a killable worker process, :mod:`.symbolic_worker`), :mod:`.gsm8k` and
:mod:`.bbh`. Design constraints, and why:

* **Never hang or crash a run.** Every symbolic check runs in a separate, persistent worker
  process that is killed and restarted when a check exceeds its deadline; a timeout, and any
  failure, scores as "not equal".
* **No heavy imports here.** These modules need only the standard library at import time;
  sympy and friends are imported inside the worker, which is started from its file by path
  and so imports neither the ``lm_eval_safe`` package nor torch.
* **Loadable without the package.** ``tasks/safe_utils.py`` loads this folder by path when
  ``lm_eval_safe`` is not installed, under another package name: the modules therefore import
  one another relatively, never as ``lm_eval_safe.answer_checking``.
* **String checks first.** Most correct answers are equal after MATH-style normalisation,
  which is cheap; the worker is only consulted when strings differ.
"""

from __future__ import annotations

from .bbh import bbh_match, extract_bbh_answer
from .gsm8k import extract_gsm8k_answer, gsm8k_gold_answer, gsm8k_match
from .math_answers import (
    MATH_PROMPT_SUFFIX,
    MAX_SYMBOLIC_CHARS,
    extract_math_answer,
    last_boxed_content,
    math_exact_match,
    normalize_math_answer,
)
from .symbolic import (
    DEFAULT_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    SymbolicChecker,
    math_equiv,
    symbolic_equal,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MATH_PROMPT_SUFFIX",
    "MAX_SYMBOLIC_CHARS",
    "STARTUP_TIMEOUT_S",
    "SymbolicChecker",
    "as_metric",
    "bbh_match",
    "extract_bbh_answer",
    "extract_gsm8k_answer",
    "extract_math_answer",
    "gsm8k_gold_answer",
    "gsm8k_match",
    "last_boxed_content",
    "math_equiv",
    "math_exact_match",
    "normalize_math_answer",
    "symbolic_equal",
]


def as_metric(value: bool) -> int:
    """lm-eval wants numbers; keep the bool->int conversion in one place."""
    return 1 if value else 0
