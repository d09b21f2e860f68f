"""Scoring a given continuation (loglikelihood) with an ensemble: SAFE_SPEC §9.

The continuation is cut at character offsets that are token boundaries of *every* member;
within a segment each member's probability is the product of its own token probabilities, and
the ensemble log-probability is the sum over segments of the log of the aggregated segment
probability. With one member every token is a segment, which is exactly lm-eval's ``hf`` score.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from lm_eval_safe.members import Member
from lm_eval_safe.vocabulary import is_char_boundary

logger = logging.getLogger(__name__)


@dataclass
class MemberScore:
    """One member's view of a continuation: per-token log-probs, greedy flags, byte ends."""

    logprobs: list[float]
    greedy: list[bool]
    ends: list[int] | None  # end offset of each token in the continuation bytes; None: unknown

    def segment(self, start: int, stop: int) -> tuple[float, bool]:
        """Sum of log-probs and all-greedy over tokens ending in (start, stop]."""
        assert self.ends is not None
        total, greedy = 0.0, True
        for lp, g, end in zip(self.logprobs, self.greedy, self.ends, strict=True):
            if start < end <= stop or (end == start == 0 and stop == 0):
                total += lp
                greedy = greedy and g
        return total, greedy


def encode_pair(
    member: Member, context: str, continuation: str
) -> tuple[list[int], list[int], str]:
    """Tokenize as lm-eval's HFLM: jointly, split at the context's tokens, trailing context
    spaces moved into the continuation; an empty context becomes the member's prefix token.
    Returns context ids, continuation ids and the continuation text they stand for."""
    context = member.render_context(context)
    if context == "":
        cont = member.encode(continuation, add_special_tokens=False)
        if not cont:
            raise ValueError("empty continuation with an empty context: nothing to score")
        if member.prefix_token_id != cont[0]:
            return [member.prefix_token_id], cont, continuation
        return cont[:1], cont[1:], continuation
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = member.encode(context + continuation)
    ctx = member.encode(context)
    return ctx, whole[len(ctx) :], continuation


@torch.inference_mode()
def score_member(member: Member, context: str, continuation: str) -> MemberScore:
    ctx, cont, cont_text = encode_pair(member, context, continuation)
    if not cont:
        return MemberScore([], [], [])
    window = (ctx + cont)[-(member.max_length + 1) :]
    if len(ctx) + len(cont) > member.max_length + 1:
        logger.warning(
            "context+continuation (%d tokens) exceed %s's window %d; truncating from the left",
            len(ctx) + len(cont),
            member.name,
            member.max_length,
        )
    if len(cont) > member.max_length:
        raise ValueError(
            f"continuation of {len(cont)} tokens is longer than {member.name}'s window ({member.max_length})"
        )
    inp = torch.tensor([window[:-1]], dtype=torch.long, device=member.model.device)
    logits = member.model(input_ids=inp, logits_to_keep=len(cont)).logits[
        0, -len(cont) :, : len(member.vocab)
    ]
    logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    target = torch.tensor(cont, dtype=torch.long)
    token_lp = logprobs.gather(1, target.unsqueeze(1)).squeeze(1)
    greedy = (logprobs.argmax(dim=-1) == target).tolist()
    ends = member.vocab.token_ends(cont, cont_text.encode("utf-8"))
    return MemberScore(token_lp.tolist(), greedy, ends)


def combine(
    scores: list[MemberScore], weights: list[float], how: str, text: bytes
) -> tuple[float, bool]:
    """Ensemble log-probability over common boundaries and the is_greedy flag (see module doc).

    ``is_greedy`` holds when, in every segment, every member's tokens are its own argmax: then
    each member's greedy draft spells the segment and SAFE's consensus rule (a) keeps it.
    """
    if len(scores) == 1:
        return sum(scores[0].logprobs), all(scores[0].greedy)
    known = [s.ends for s in scores if s.ends is not None]
    cuts = set.intersection(*(set(e) for e in known)) if known else set()
    total_bytes = len(text)
    cuts = sorted(c for c in cuts if 0 < c < total_bytes and is_char_boundary(text, c)) + [total_bytes]
    norm = [w / sum(weights) for w in weights]
    total, greedy, start = 0.0, True, 0
    for stop in cuts:
        parts = []
        for score in scores:
            if score.ends is None:  # this member's tokens do not spell the text: one segment only
                lp, g = (
                    (sum(score.logprobs), all(score.greedy)) if stop == total_bytes else (0.0, True)
                )
            else:
                lp, g = score.segment(start, stop)
            parts.append(lp)
            greedy = greedy and g
        if how == "logmean":
            total += sum(w * lp for w, lp in zip(norm, parts, strict=True))
        else:
            top = max(parts)
            total += top + math.log(
                sum(w * math.exp(lp - top) for w, lp in zip(norm, parts, strict=True))
            )
        start = stop
    return total, greedy
