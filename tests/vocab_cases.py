"""The tokenizers the vocabulary tests read (tiny ones built in-process, the real members'),
the hard texts they spell, and how a test gets one by name (the fixtures loading them once
per session are conftest.py's ``tiny_loaded`` and ``real_loaded``); imported by
tests/members/test_token_boundaries.py and tests/members/test_vocabulary.py."""

from __future__ import annotations

from typing import Any

import pytest

from lm_eval_safe.members.vocabulary import TokenVocabulary

HARD_TEXTS = [
    r"\frac{a}{b}",
    r"\boxed{42}",
    "123456789",
    "a    b   c",
    "x\n\ny",
    "\n\nafter newlines",
    "café naïve",
    "数学问题",
    "👍🏽 ok",
    " leading",
    "  two leading spaces",
    "trailing spaces   ",
    r"The answer is $\frac{1}{2}$, so \boxed{42}." + "\n\n",
    "emoji 🙂🚀 in 数学 text: naïve \\frac{3}{4}",
]

TINY = ("tiny_bpe", "tiny_sp")
REAL = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
# The tiny SentencePiece-style decoder ends with Strip(" ", 1, 0) (as Llama-2's does): decoding
# drops one leading space, real or dummy. Every other decoder here is lossless.
STRIPS_ONE_LEADING_SPACE = {"tiny_sp"}

ALL_NAMES = [*TINY, *(pytest.param(name, marks=pytest.mark.real) for name in REAL)]
PAIRS = [
    ("tiny_bpe", "tiny_sp"),
    pytest.param("smollm2-135m", "gemma3-270m", marks=pytest.mark.real),
    pytest.param("smollm2-135m", "qwen2.5-coder-0.5b", marks=pytest.mark.real),
    pytest.param("gemma3-270m", "qwen2.5-coder-0.5b", marks=pytest.mark.real),
]

def _get(request: pytest.FixtureRequest, name: str) -> tuple[Any, TokenVocabulary]:
    """Look a tokenizer up by name, instantiating only the fixture that holds it."""
    fixture = "tiny_loaded" if name in TINY else "real_loaded"
    return request.getfixturevalue(fixture)[name]


