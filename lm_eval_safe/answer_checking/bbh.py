"""The answer after "the answer is" in a BBH generation, matched against the target."""

from __future__ import annotations

import logging
import re

from .math_answers import PHRASE_WINDOW

logger = logging.getLogger(__name__)

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
    tail = text[idx + len("the answer is") : idx + len("the answer is") + PHRASE_WINDOW]
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
