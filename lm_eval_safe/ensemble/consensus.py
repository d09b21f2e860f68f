"""The consensus gate (docs/algorithm.md, Consensus): when SAFE may skip the ensemble because
every member already agrees with the drafter's token, and GaC's gate on the drafter's own
certainty. Shared by the schedules and by loglikelihood's ``is_greedy``; decisions from engine
heads bound the same rule (:func:`lm_eval_safe.ensemble.certified.certified_consensus`)."""

from __future__ import annotations

from collections.abc import Sequence

#: GaC's gate: a drafter at least this sure of its token is never ensembled.
GAC_GATE = 0.5


def consensus(own_is_argmax: Sequence[bool], own_probs: Sequence[float], weights: Sequence[float]) -> bool:
    """SAFE's skip rules: (a) every verifier's argmax is its own next token
    (``own_is_argmax``, verifiers only), or (b) the weighted mean over all members of each one's
    probability of its own next token exceeds 0.5 (``own_probs`` and ``weights`` in one order,
    every member). By the paper's Theorem 1 either makes the drafter's token the mean
    aggregate's argmax, so skipping the ensemble loses nothing. Shared by the decoder and by
    loglikelihood's ``is_greedy``."""
    if all(own_is_argmax):
        return True
    mean = sum(w * p for w, p in zip(weights, own_probs, strict=True)) / sum(weights)
    return mean > 0.5
