"""Running a member on one sequence through a kept cache, and log-probs over its own tokenizer's
ids (never over padded embedding rows).

Shared by the batch (:mod:`lm_eval_safe.batching`), which runs a lone prompt exactly as an
unbatched request does, and by scoring."""

from __future__ import annotations

from typing import Any

import torch

from lm_eval_safe.engines.hf import model_calls
from lm_eval_safe.members.member import Member


def vocab_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over the tokenizer's ids only, in at least float32.

    Models may pad the embedding matrix beyond the tokenizer (Qwen: 151936 vs 152064 rows):
    those rows are not tokens and never take part. bf16 log-probs are too coarse to compare
    members; float64 stays float64."""
    logits = logits[..., :vocab_size]
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


@torch.inference_mode()
def forward_logprobs(
    member: Member, ids: list[int], cache: Any, keep: int | list[int]
) -> torch.Tensor:
    """:func:`forward_logits`' log-softmax, on the CPU."""
    return torch.log_softmax(forward_logits(member, ids, cache, keep), dim=-1).cpu()


def forward_logits(
    member: Member, ids: list[int] | torch.Tensor, cache: Any, keep: int | list[int]
) -> torch.Tensor:
    """Feed ``ids`` (one sequence; or a ``[1, n]`` tensor of them on the member's device, a
    token drafted there and never read back) through ``cache``; the logits over the
    tokenizer's ids (:func:`vocab_logits`) at the last ``keep`` positions (an int) or at the
    listed positions of ``ids``, on the member's device.

    Only the needed rows go through the output layer: for a 262k vocabulary it costs more than
    the rest of a small model. Callers hold the inference mode (an engine call, or
    :func:`forward_logprobs`): entering it once a step cost more than the rest of this call.
    """
    if isinstance(ids, torch.Tensor):
        input_ids = ids
    else:
        input_ids = torch.tensor([ids], dtype=torch.long, device=member.engine.input_device)
    if isinstance(keep, int):
        to_keep: int | torch.Tensor = keep
    else:
        # on cpu: with device_map=auto the hidden states it indexes sit on the last device
        to_keep = torch.tensor(keep if keep else [input_ids.shape[1] - 1], dtype=torch.long)
    out = model_calls.run(member.engine.model, cache, input_ids=input_ids, logits_to_keep=to_keep)
    logits = out.logits[0]
    if isinstance(keep, int):
        logits = logits[-keep:]
    elif not keep:
        logits = logits[:0]
    return vocab_logits(logits, len(member.vocab))
