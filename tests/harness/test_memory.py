"""Memory stays flat over a long run: 200 generate requests of 256 tokens on the
tiny members, in one ``generate_until`` call as lm-eval makes it, sampled with the probe of
``lm_eval_safe.bench.memory`` that ``lm-eval-safe bench memory`` uses on the real members."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_lm, random_prompts

from lm_eval_safe.bench.eos import mask_eos
from lm_eval_safe.bench.memory import generate_with_probe
from lm_eval_safe.harness import model as model_module

pytestmark = pytest.mark.slow  # whole processes and end-to-end runs: the slow tier


def test_200_requests_of_256_tokens_keep_memory_flat(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = 64
    monkeypatch.setattr(model_module, "REQUEST_STATS_KEPT", kept)
    # The prefix store (32 blocks of 8 KiB here) is full within the first 50 random prompts and
    # then stays at its budget: a bounded cache is part of the steady state measured, not growth.
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, batch_size=32, prefix_cache_mb=0.25)
    mask_eos(lm.members)  # every request runs its full 256 tokens
    probe, texts = generate_with_probe(lm, random_prompts(200, seed=21), 256, [50, 100, 150, 200])
    assert lm.run_stats.generated_tokens == 200 * 256 and lm.run_stats.requests == 200
    assert lm.run_stats.ensemble_ops > 0 and lm.run_stats.verifier_positions > 0
    assert len(texts) == 200
    s = probe.samples
    print("RSS MiB at 50/100/200:", [s[n]["rss_mib"] for n in (50, 100, 200)])
    print("live tensor MiB at 50/100/150/200:", [s[n]["tensor_mib"] for n in (50, 100, 150, 200)])
    print("Python objects at 50/100/150/200:", [s[n]["objects"] for n in (50, 100, 150, 200)])
    # At 50 and 150 done, 32 rows are in flight either way: KV caches and kept distributions
    # take the same room. A decoder keeping one distribution row per request would add
    # >100 x 256 x vocab floats (tens of MiB) here.
    assert s[150]["tensor_mib"] <= s[50]["tensor_mib"] * 1.25
    # After the last request only the weights (and the union vocabulary) remain.
    assert s[200]["tensor_mib"] <= s[50]["tensor_mib"]
    # Python objects may grow by the responses themselves (text + its stats), not more.
    assert s[150]["objects"] - s[50]["objects"] < 100 * 10
    assert s[200]["rss_mib"] - s[50]["rss_mib"] < 64
    assert len(lm.request_stats) == kept
    for member in lm.members:
        assert 0 < member.engine.prefix_store.bytes <= member.engine.prefix_store.budget
