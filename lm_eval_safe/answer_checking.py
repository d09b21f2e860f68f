"""Answer extraction and equivalence checking for the SAFE benchmark tasks.

The task configs in ``tasks/`` (``safe_math500``, ``safe_gsm8k``, ``safe_bbh``)
score generations with the functions here.  Design constraints, and why:

* **Never hang or crash a run.**  Symbolic equivalence (sympy, latex2sympy2,
  math-verify) can take unbounded time or memory on adversarial input
  (``2^{2^{100}}``, huge matrices, malformed LaTeX).  ``signal.alarm`` only works
  on the main thread, and lm-eval (or our ensemble backend) may score from a
  worker thread; a thread that is merely abandoned keeps the GIL busy and big-int
  arithmetic never releases it.  So every symbolic check runs in a separate,
  persistent worker *process* (started with ``subprocess``, not ``fork``, so it is
  safe in a process that holds CUDA contexts and threads) which is killed and
  restarted when a check exceeds its deadline.  A timeout scores as "not equal".
* **No heavy imports here.**  This module only needs the standard library at
  import time; sympy and friends are imported inside the worker.  The worker loads
  this very file by path, so it does not import the ``lm_eval_safe`` package
  (and therefore not torch).
* **String checks first.**  Most correct answers are equal after MATH-style
  normalisation, which is cheap; the worker is only consulted when strings
  differ.

Public API: :func:`extract_math_answer`, :func:`normalize_math_answer`,
:func:`math_exact_match`, :func:`math_equiv`, :func:`symbolic_equal`,
:func:`extract_gsm8k_answer`, :func:`gsm8k_gold_answer`, :func:`gsm8k_match`,
:func:`extract_bbh_answer`, :func:`bbh_match`, :class:`SymbolicChecker`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds one symbolic comparison may take before it scores as "not equal".
DEFAULT_TIMEOUT_S = 5.0
#: Seconds the worker may take to import sympy/math-verify and report ready.
STARTUP_TIMEOUT_S = 120.0
#: Answers longer than this are compared as strings only: no sensible final
#: answer is that long, and parsing such strings is where the cost explodes.
MAX_SYMBOLIC_CHARS = 1000
#: How far after an "answer is" phrase we look for the answer (keeps
#: extraction linear on 100k-character generations).
_PHRASE_WINDOW = 400

# --------------------------------------------------------------------------
# Extraction of the final answer from a MATH-style generation
# --------------------------------------------------------------------------

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_MAX_BOX_CANDIDATES = 20
_MAX_BOX_CHARS = 20_000


def _balanced_group(text: str, start: int, max_len: int = 1 << 62) -> tuple[str, int] | None:
    """Return the content of the ``{...}`` group opening at ``text[start]``.

    Braces are counted (escaped ``\\{``/``\\}`` are skipped) so that nested
    groups such as ``\\boxed{\\frac{1}{2}}`` come out whole.  Returns ``None`` when
    the group never closes (malformed or truncated output).
    """
    depth = 0
    i = start
    n = min(len(text), start + max_len)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (or ``\\boxed 5``).

    The last box wins because models often box intermediate results before the
    final one.  A last box that never closes (truncated or malformed output)
    is skipped and the previous complete box is used, since the model may have
    boxed its answer before it started rambling.
    """
    positions: list[int] = []
    for cmd in _BOX_COMMANDS:
        start = 0
        while True:
            idx = text.find(cmd, start)
            if idx < 0:
                break
            end = idx + len(cmd)
            # reject e.g. \boxedx (another macro name)
            if end < len(text) and text[end].isalpha():
                start = end
                continue
            positions.append(idx)
            start = end
    # Only the last few boxes are candidates, and a box content is at most
    # _MAX_BOX_CHARS long: keeps this linear on adversarial 100k-char outputs.
    for idx in sorted(positions, reverse=True)[:_MAX_BOX_CANDIDATES]:
        cmd = "\\boxed" if text.startswith("\\boxed", idx) else "\\fbox"
        j = idx + len(cmd)
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            group = _balanced_group(text, j, _MAX_BOX_CHARS)
            if group is not None:
                return group[0].strip()
            continue
        if j > idx + len(cmd):  # "\boxed 5" form: one token up to $ or space
            m = re.match(r"[^\s$]+", text[j : j + 200])
            if m:
                return m.group(0).rstrip(".,;")
    return None


_FINAL_PHRASES = (
    "final answer is",
    "final answer:",
    "the answer is",
    "answer:",
)


def _answer_after_phrase(text: str) -> str | None:
    """Answer following the last "final answer is"/"The answer is" phrase.

    Uses ``rfind`` on a lower-cased copy rather than a regex so the cost stays
    linear for enormous generations.
    """
    lower = text.lower()
    for phrase in _FINAL_PHRASES:
        idx = lower.rfind(phrase)
        if idx < 0:
            continue
        tail = text[idx + len(phrase) : idx + len(phrase) + _PHRASE_WINDOW]
        tail = tail.lstrip(" :\t")
        if tail.lower().startswith("the final answer is"):
            tail = tail[len("the final answer is") :].lstrip()
        # "Final Answer: The final answer is $x$. I hope it is correct."
        tail = tail.split("\n", 1)[0]
        tail = re.split(r"\.\s+I hope|\s+I hope", tail, maxsplit=1)[0]
        if tail.startswith("$"):
            close = tail.find("$", 1)
            if close > 0:
                return tail[1:close].strip()
        ans = tail.strip().rstrip(".").strip().strip("$").strip()
        if ans:
            return ans
    return None


def extract_math_answer(text: str) -> str | None:
    """Final answer of a MATH-style generation, or ``None`` if there is none.

    Order: last ``\\boxed{}``/``\\fbox{}``; then "Final Answer: ..." / "The final
    answer is ..." / "The answer is ...".
    """
    if not text:
        return None
    boxed = last_boxed_content(text)
    if boxed is not None:
        return boxed
    return _answer_after_phrase(text)


# --------------------------------------------------------------------------
# MATH string normalisation (Hendrycks et al. + Minerva conventions)
# --------------------------------------------------------------------------

_SUBSTITUTIONS = [
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\:", ""),
    ("\\!", ""),
    ("\\displaystyle", ""),
    ("\\mathrm", "\\text"),
    ("\\textbf", "\\text"),
    ("\\mbox", "\\text"),
    ("\\tfrac", "\\frac"),
    ("\\dfrac", "\\frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("°", ""),
    ("\\%", ""),
    ("%", ""),
]

# Unit words and filler removed by the Minerva normaliser (kept short and
# word-bounded so that we never delete parts of real math).
_UNIT_WORDS = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "inch",
    "feet",
    "foot",
    "hours",
    "hour",
    "km",
    "units",
    "unit",
    "sue",
    "points",
    "point",
    "minutes",
    "minute",
    "seconds",
    "second",
    "meters",
    "meter",
    "cents",
    "cent",
    "degrees",
    "degree",
    "cm",
    "gm",
    "pounds",
    "pound",
    "mm",
    "miles",
    "mile",
    "days",
    "day",
    "years",
    "year",
    "students",
    "student",
    "people",
    "sq",
]
_UNIT_RE = re.compile(
    r"\\text\{\s*(?:" + "|".join(_UNIT_WORDS) + r")(?:\^?\d)?\s*\}"
    r"|(?<![A-Za-z\\])(?:" + "|".join(_UNIT_WORDS) + r")(?:\^?\d)?(?![A-Za-z])"
)
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + rest
        else:
            out += "{" + a + "}{" + b + "}" + rest
    return out


def _fix_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    return re.sub(r"\\sqrt(?!\{)(\w)", r"\\sqrt{\1}", s)


def _fix_a_slash_b(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when the whole answer is a simple fraction."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


def _unwrap_text(s: str) -> str:
    """Replace ``\\text{abc}`` by ``abc`` (balanced braces, any nesting)."""
    for _ in range(20):
        idx = s.find("\\text{")
        if idx < 0:
            break
        group = _balanced_group(s, idx + len("\\text"))
        if group is None:
            break
        s = s[:idx] + group[0] + s[group[1] :]
    return s


def normalize_math_answer(answer: str | None) -> str:
    """Normalise a MATH final answer for string comparison.

    Follows the conventions of the MATH paper's ``strip_string`` and Minerva's
    ``normalize_final_answer``: ``\\dfrac``/``\\tfrac`` -> ``\\frac``, no
    ``\\left``/``\\right``, degrees, percent, dollars, thin spaces ``\\!``,
    trailing periods, unit words, ``\\text{}`` wrappers, thousands separators,
    ``x = 3`` -> ``3`` and whitespace.  Returns "" for ``None``.
    """
    if answer is None:
        return ""
    s = str(answer).strip()
    if len(s) > 10 * MAX_SYMBOLIC_CHARS:
        return s  # pathological; compare raw
    s = s.replace("\n", "").replace("\\\\", "\\")
    s = s.rstrip(".").strip()
    s = s.strip("$").strip()
    # "x = 3" / "k=5" -> "3" (short left-hand side only, like the MATH grader)
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if len(lhs.strip()) <= 2 and rhs.strip():
            s = rhs.strip()
    s = _UNIT_RE.sub("", s)
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    s = _unwrap_text(s)
    s = s.replace("\\mathbf", "").replace("\\boldsymbol", "")
    s = re.sub(r"\\(?:q)?quad", "", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".").rstrip("\\").strip()
    s = s.replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    s = _fix_sqrt(s)
    s = _fix_fracs(s)
    s = _fix_a_slash_b(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    # ^{2} vs ^2
    s = re.sub(r"\^\{(\w)\}", r"^\1", s)
    # integers written as 5.0 / 5.00
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def math_exact_match(prediction: str | None, gold: str) -> bool:
    """Normalised string equality of two final answers (the ``exact_match`` metric)."""
    if prediction is None:
        return False
    pred_n, gold_n = normalize_math_answer(prediction), normalize_math_answer(gold)
    if not pred_n or not gold_n:
        # everything was stripped as a "unit" (e.g. "\text{second}"): compare raw
        return prediction.strip().lower() == gold.strip().lower() != ""
    return pred_n == gold_n


# --------------------------------------------------------------------------
# Symbolic comparison in a killable worker process
# --------------------------------------------------------------------------


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


def _worker_main() -> None:
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


# The worker loads this file by path (not as ``lm_eval_safe.answer_checking``, so
# the package and torch are not imported) with the script's folder and the cwd
# off ``sys.path``, so that no sibling module can shadow sympy's imports.
_WORKER_BOOT = (
    "import sys, importlib.util as u\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
    "s = u.spec_from_file_location('lm_eval_safe_checker_worker', sys.argv[1])\n"
    "m = u.module_from_spec(s)\n"
    "s.loader.exec_module(m)\n"
    "m._worker_main()\n"
)


class SymbolicChecker:
    """A persistent, killable worker process for symbolic comparisons.

    Thread-safe (one request at a time per checker).  If a comparison exceeds
    ``timeout_s`` the worker is killed, the comparison scores ``False`` and the
    next call starts a new worker.  If the worker cannot be started at all
    (missing sympy, no subprocesses allowed) symbolic checks score ``False`` and
    a warning is logged once, i.e. scoring degrades to string matching.
    """

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, worker_cmd: list[str] | None = None
    ) -> None:
        """``worker_cmd`` replaces the worker command line (tests use a stalling one)."""
        self.timeout_s = timeout_s
        self._cmd = worker_cmd or [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(__file__)]
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._broken = False
        self.timeouts = 0
        atexit.register(self.close)

    def _start(self) -> bool:
        try:
            self._proc = subprocess.Popen(
                self._cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                close_fds=True,
            )
        except OSError as exc:
            logger.warning("cannot start symbolic checker worker (%s); string matching only", exc)
            self._broken = True
            return False
        self._buf = b""
        reply = self._read_line(STARTUP_TIMEOUT_S)
        if reply is None or not json.loads(reply).get("ready"):
            logger.warning("symbolic checker worker did not start; string matching only")
            self._kill()
            self._broken = True
            return False
        return True

    def _read_line(self, timeout: float) -> bytes | None:
        """Read one line from the worker within ``timeout`` seconds, else ``None``."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # worker died
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.kill()
            proc.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Stop the worker process (also registered with ``atexit``)."""
        with self._lock:
            self._kill()

    def equal(self, gold: str, pred: str) -> bool:
        """True iff the worker shows ``gold`` and ``pred`` equal within the timeout."""
        if len(gold) > MAX_SYMBOLIC_CHARS or len(pred) > MAX_SYMBOLIC_CHARS:
            return False
        with self._lock:
            if self._broken:
                return False
            needs_start = self._proc is None or self._proc.poll() is not None
            if needs_start and not self._start():
                return False
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write((json.dumps({"gold": gold, "pred": pred}) + "\n").encode())
                self._proc.stdin.flush()
            except OSError:
                self._kill()
                return False
            reply = self._read_line(self.timeout_s)
            if reply is None:
                self.timeouts += 1
                logger.info("symbolic check timed out after %.1fs; scored as wrong", self.timeout_s)
                self._kill()
                return False
            try:
                return bool(json.loads(reply).get("eq"))
            except ValueError:
                return False


_default_checker: SymbolicChecker | None = None
_default_lock = threading.Lock()
_cache: dict[tuple[str, str], bool] = {}
_CACHE_MAX = 100_000


def _get_default_checker() -> SymbolicChecker:
    global _default_checker
    with _default_lock:
        if _default_checker is None:
            _default_checker = SymbolicChecker()
        return _default_checker


def symbolic_equal(gold: str, pred: str, checker: SymbolicChecker | None = None) -> bool:
    """Symbolic equivalence under a hard timeout (never raises, never hangs)."""
    key = (gold, pred)
    if key in _cache:
        return _cache[key]
    result = (checker or _get_default_checker()).equal(gold, pred)
    if len(_cache) < _CACHE_MAX:
        _cache[key] = result
    return result


def math_equiv(generation: str | None, gold: str, checker: SymbolicChecker | None = None) -> bool:
    """The ``math_equiv`` metric: is the generation's final answer equal to ``gold``?

    Extracts the answer (:func:`extract_math_answer`), accepts normalised string
    equality, else asks the symbolic worker.  Any failure scores ``False``.
    """
    try:
        pred = extract_math_answer(generation or "")
        if pred is None:
            return False
        if math_exact_match(pred, gold):
            return True
        if len(pred) > MAX_SYMBOLIC_CHARS:
            return False
        g_norm = normalize_math_answer(gold)
        p_norm = normalize_math_answer(pred)
        if not p_norm:
            return False
        if symbolic_equal(gold, pred, checker):
            return True
        # normalisation removes units/\text wrappers math-verify may trip on
        return (g_norm, p_norm) != (gold, pred) and symbolic_equal(g_norm, p_norm, checker)
    except Exception:  # noqa: BLE001 - scoring must never crash a run
        logger.exception("math_equiv failed; scoring as wrong")
        return False


# --------------------------------------------------------------------------
# GSM8K
# --------------------------------------------------------------------------

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _to_fraction(token: str) -> Fraction | None:
    """Parse ``1,000``/``-3.50``/``\\frac{1}{2}``/``7/2`` into an exact Fraction."""
    t = token.strip().replace("\\$", "").replace("$", "").replace("\\!", "")
    t = t.replace("\\%", "").replace("%", "").replace(" ", "").rstrip(".")
    t = _unwrap_text(t)
    m = re.fullmatch(r"-?\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", t)
    if m:
        neg = t.startswith("-")
        try:
            value = Fraction(int(m.group(1)), int(m.group(2)))
        except ZeroDivisionError:
            return None
        return -value if neg else value
    m = re.fullmatch(r"(-?\d+)/(\d+)", t)
    if m:
        try:
            return Fraction(int(m.group(1)), int(m.group(2)))
        except ZeroDivisionError:
            return None
    t = t.replace(",", "")
    try:
        return Fraction(Decimal(t))
    except (InvalidOperation, ValueError):
        return None


def _last_number(text: str) -> Fraction | None:
    last = None
    for m in _NUMBER_RE.finditer(text):
        last = m.group(0)
    return _to_fraction(last) if last is not None else None


def extract_gsm8k_answer(text: str | None) -> Fraction | None:
    """Numeric answer of a GSM8K generation: boxed, else "answer is", else last number."""
    if not text:
        return None
    boxed = last_boxed_content(text)
    if boxed is not None:
        value = _to_fraction(boxed)
        return value if value is not None else _last_number(boxed[:_PHRASE_WINDOW])
    lower = text.lower()
    for phrase in ("final answer is", "the answer is", "answer:", "####"):
        idx = lower.rfind(phrase)
        if idx >= 0:
            m = _NUMBER_RE.search(text, idx + len(phrase), idx + len(phrase) + _PHRASE_WINDOW)
            if m:
                return _to_fraction(m.group(0))
    return _last_number(text)


def gsm8k_gold_answer(answer_field: str) -> Fraction:
    """The gold number of a GSM8K ``answer`` field (text after ``####``)."""
    value = _to_fraction(answer_field.split("####")[-1])
    if value is None:
        raise ValueError(f"unparseable GSM8K gold answer: {answer_field[-50:]!r}")
    return value


def gsm8k_match(generation: str | None, answer_field: str) -> bool:
    """True iff the generation's number equals the gold number (exact rational)."""
    try:
        pred = extract_gsm8k_answer(generation)
        return pred is not None and pred == gsm8k_gold_answer(answer_field)
    except Exception:  # noqa: BLE001
        logger.exception("gsm8k_match failed; scoring as wrong")
        return False


# --------------------------------------------------------------------------
# BBH
# --------------------------------------------------------------------------

_OPTION_RE = re.compile(r"^\(([A-R])\)(?=$|[\s.,:;])|^([A-R])(?:\)|\.|:)?(?=$|\s)")


def extract_bbh_answer(text: str | None) -> str | None:
    """Text after the last "the answer is" (any case), without trailing period.

    Markdown bold, ``$`` and surrounding quotes are stripped; the answer ends
    at the end of the line.
    """
    if not text:
        return None
    lower = text.lower()
    idx = lower.rfind("the answer is")
    if idx < 0:
        return None
    tail = text[idx + len("the answer is") : idx + len("the answer is") + _PHRASE_WINDOW]
    tail = tail.lstrip(" :").split("\n", 1)[0].strip()
    tail = tail.replace("**", "").replace("$", "").strip()
    tail = tail.rstrip(".").strip().strip("\"'`").strip()
    return tail or None


def _norm_bbh(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().rstrip(".").strip()).casefold()


def bbh_match(generation: str | None, target: str) -> bool:
    """Exact match of the extracted BBH answer against ``target``.

    Option targets ``(A)`` also accept ``A``, ``(A) <option text>`` and ``A)``;
    other targets compare case-insensitively with whitespace collapsed.
    """
    try:
        pred = extract_bbh_answer(generation)
        if pred is None:
            return False
        tgt = target.strip()
        m_t = re.fullmatch(r"\(([A-R])\)", tgt)
        if m_t:
            m_p = _OPTION_RE.match(pred)
            if not m_p:
                return False
            letter = m_p.group(1) or m_p.group(2)
            return letter == m_t.group(1)
        return _norm_bbh(pred) == _norm_bbh(tgt)
    except Exception:  # noqa: BLE001
        logger.exception("bbh_match failed; scoring as wrong")
        return False


def as_metric(value: bool) -> int:
    """lm-eval wants numbers; keep the bool->int conversion in one place."""
    return 1 if value else 0
