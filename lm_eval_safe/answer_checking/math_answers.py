"""Final answers of MATH-style generations, and their normalisation for string comparison.

Everything here is string work with the standard library, linear in the length of the
generation: a model's output may be 100k characters of rambling, and scoring must stay cheap.
The symbolic comparison that follows a string mismatch lives in :mod:`.symbolic`.
"""

from __future__ import annotations

import re

#: The paper's zero-shot chain-of-thought instruction (docs/algorithm.md, The paper's numbers), appended to every math
#: question; it asks for the ``\\boxed{}`` that :func:`last_boxed_content` reads back.
MATH_PROMPT_SUFFIX = " Please reason step by step, and put your final answer within \\boxed{}."
#: Answers longer than this are compared as strings only: no sensible final
#: answer is that long, and parsing such strings is where the cost explodes.
MAX_SYMBOLIC_CHARS = 1000
#: How far after an "answer is" phrase we look for the answer (keeps
#: extraction linear on 100k-character generations).
PHRASE_WINDOW = 400

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
        tail = text[idx + len(phrase) : idx + len(phrase) + PHRASE_WINDOW]
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


def unwrap_text(s: str) -> str:
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
    s = unwrap_text(s)
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
