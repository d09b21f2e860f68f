"""The numeric answer of a GSM8K generation, compared exactly (as a rational) with the gold one."""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from .math_answers import PHRASE_WINDOW, last_boxed_content, unwrap_text

logger = logging.getLogger(__name__)

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _to_fraction(token: str) -> Fraction | None:
    """Parse ``1,000``/``-3.50``/``\\frac{1}{2}``/``7/2`` into an exact Fraction."""
    t = token.strip().replace("\\$", "").replace("$", "").replace("\\!", "")
    t = t.replace("\\%", "").replace("%", "").replace(" ", "").rstrip(".")
    t = unwrap_text(t)
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
        return value if value is not None else _last_number(boxed[:PHRASE_WINDOW])
    lower = text.lower()
    for phrase in ("final answer is", "the answer is", "answer:", "####"):
        idx = lower.rfind(phrase)
        if idx >= 0:
            m = _NUMBER_RE.search(text, idx + len(phrase), idx + len(phrase) + PHRASE_WINDOW)
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
