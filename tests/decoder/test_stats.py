"""The views of a request's statistics (a response's ``safe`` field, a trace line's counts, the
speed benchmark's) name fields that :class:`GenerationStats` has, once each."""

from __future__ import annotations

from dataclasses import fields

import pytest

from lm_eval_safe.decoder.stats import (
    BENCH_COUNTS,
    RESPONSE_COUNTS,
    TRACE_COUNTS,
    GenerationStats,
    counts,
    total,
)


@pytest.mark.parametrize("names", [RESPONSE_COUNTS, TRACE_COUNTS, BENCH_COUNTS])
def test_views_name_fields(names: tuple[str, ...]) -> None:
    known = {f.name for f in fields(GenerationStats)}
    assert set(names) <= known
    assert len(set(names)) == len(names)


def test_counts_and_total() -> None:
    a = GenerationStats(generated_tokens=3, cycles=1, verifier_forwards={"v": 2})
    b = GenerationStats(generated_tokens=4, cycles=2, verifier_forwards={"v": 1, "w": 5})
    both = total([a, b])
    assert counts(both, ("cycles", "generated_tokens")) == {"cycles": 3, "generated_tokens": 7}
    assert both.verifier_forwards == {"v": 3, "w": 5}
    assert a.generated_tokens == 3  # the parts are left as they were
