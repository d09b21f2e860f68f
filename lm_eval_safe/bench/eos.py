"""Members that never predict EOS (``--ignore-eos``, ``bench_memory``'s default).

Speed and memory are measured per generated token, so every method should generate exactly
``max_new_tokens``: an instruct member that ends at once (SmolLM2-Instruct answers a plain-text
prompt with ``<|im_end|>``) would leave nothing to measure. The texts are then not answers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def mask_eos(members: Iterable[Any]) -> None:
    """Make no member ever predict EOS: a forward hook on each output layer sets the EOS logits
    to ``-inf``. Every path that produces logits goes through that layer (a forward pass, the
    batched decoder's output head, ``transformers.generate``), so all of them see the mask.
    On a model with final-logit soft-capping (Gemma-2) a masked logit becomes the cap's
    minimum instead of ``-inf``, which no argmax picks."""
    for member in members:
        eos = torch.tensor(sorted(member.eos_ids), dtype=torch.long)
        head = member.engine.model.get_output_embeddings()

        def hook(_module: Any, _inputs: Any, logits: torch.Tensor, eos: torch.Tensor = eos) -> Any:
            return logits.index_fill(-1, eos.to(logits.device), float("-inf"))

        head.register_forward_hook(hook)
