"""Scoring given continuations with an ensemble (docs/algorithm.md, Scoring): ``pairs`` tokenizes
as lm-eval does and lets each member's engine score; ``loglikelihood`` assembles lm-eval's
``loglikelihood`` and ``loglikelihood_rolling`` from aligned segments."""
