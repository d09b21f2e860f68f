"""Symbolic equivalence of two answers, in a persistent worker process that can be killed.

Symbolic equivalence (sympy, latex2sympy2, math-verify) can take unbounded time or memory on
adversarial input (``2^{2^{100}}``, huge matrices, malformed LaTeX). ``signal.alarm`` only
works on the main thread, and lm-eval (or the ensemble backend) may score from a worker thread;
a thread that is merely abandoned keeps the GIL busy and big-int arithmetic never releases it.
So every symbolic check runs in a separate worker *process* (:mod:`.symbolic_worker`, started
with ``subprocess``, not ``fork``, so it is safe in a process that holds CUDA contexts and
threads), which is killed and restarted when a check exceeds its deadline. A timeout scores as
"not equal".
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

from .math_answers import (
    MAX_SYMBOLIC_CHARS,
    extract_math_answer,
    math_exact_match,
    normalize_math_answer,
)

logger = logging.getLogger(__name__)

#: Seconds one symbolic comparison may take before it scores as "not equal".
DEFAULT_TIMEOUT_S = 5.0
#: Seconds the worker may take to import sympy/math-verify and report ready.
STARTUP_TIMEOUT_S = 120.0
#: The worker's file, started by path (see :data:`_WORKER_BOOT`).
WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "symbolic_worker.py")

# The worker loads its file by path (not as a module of ``lm_eval_safe``, so the
# package and torch are not imported) with the script's folder and the cwd off
# ``sys.path``, so that no sibling module can shadow sympy's imports.
_WORKER_BOOT = (
    "import sys, importlib.util as u\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
    "s = u.spec_from_file_location('lm_eval_safe_checker_worker', sys.argv[1])\n"
    "m = u.module_from_spec(s)\n"
    "s.loader.exec_module(m)\n"
    "m.main()\n"
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
        self._cmd = worker_cmd or [sys.executable, "-c", _WORKER_BOOT, WORKER_FILE]
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
