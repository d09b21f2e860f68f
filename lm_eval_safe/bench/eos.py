"""Members that never predict EOS (``--ignore-eos``, ``bench_memory``'s default).

Speed and memory are measured per generated token, so every method should generate exactly
``max_new_tokens``: an instruct member that ends at once (SmolLM2-Instruct answers a plain-text
prompt with ``<|im_end|>``) would leave nothing to measure. The texts are then not answers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lm_eval_safe.engines import instruments


def mask_eos(members: Iterable[Any]) -> None:
    """Make no member ever predict EOS, each by its engine's instrument (the transformers
    engine: a forward hook on the output layer, which every path to the logits goes through,
    sets the EOS logits to ``-inf``); a member on an engine without instruments is refused."""
    for member in members:
        instruments(member).mask_eos(member)
