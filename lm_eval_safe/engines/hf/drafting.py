"""A transformers batch's drafts: single-token forwards, each feeding the token the step before
drafted; read back step by step, or (greedy, on a GPU) kept on the device for a whole window.

:class:`DraftingBatch` is the half of :class:`~.batch.MemberBatch` that drafts: it asks the
batch's forwards only through the methods it declares, so this module needs nothing of
:mod:`.batch` (which builds on it)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from lm_eval_safe.engines.base import Draft, Drafted, EngineBatch, Forward
from lm_eval_safe.engines.hf import heads
from lm_eval_safe.engines.hf.heads import CutHeads, Want
from lm_eval_safe.members.member import Member


@dataclass
class DraftStep(Forward):
    """One token of ``draft``: read back as the argmax (greedy), with its head when the draft
    reads rows, or as the full row its sampler draws from. ``fed``: the one id fed is the
    previous step's token at this index of its tokens on the device (``ids`` holds a
    placeholder: the token was never read back)."""

    draft: Draft | None = None
    fed: int | None = None


class DraftingBatch(EngineBatch):
    """A transformers batch's :class:`Draft` calls, served by the batch's own forwards."""

    member: Member

    @abstractmethod
    def forward(
        self, calls: dict[int, Forward], fed: torch.Tensor | None = None
    ) -> tuple[list[tuple[torch.Tensor, list[Want]]], list[list[int]]]:
        """The rows' forwards, nothing read back (:meth:`.batch.MemberBatch.forward`)."""

    def answer_drafts(self, calls: dict[int, Draft]) -> dict[int, Drafted]:
        """Each row's draft as single-token forwards: the first feeds the call's ids, each later
        one the token drafted before it; a row leaves the batch after its ``n``-th token or a
        stop id. Greedy rows take the argmax (their rows are heads of one id, the decoder asks
        for more where it needs them; none at all when the call reads tokens only), sampled
        ones their sampler's draw from the full row.

        Each step's tokens are read back before the next step (a stop id saves the forwards
        after it), unless the engine keeps drafts on the device (:attr:`~.HFEngine.
        resident_drafts`, a GPU): then greedy windows run as :meth:`draft_on_device`."""
        if self.member.engine.resident_drafts and all(c.sampler is None for c in calls.values()):
            return self.draft_on_device(calls)
        drafted = {row: Drafted([], []) for row in calls}
        steps = {row: DraftStep(c.member, c.keep, c.ids, [len(c.ids) - 1], c) for row, c in calls.items()}
        while steps:
            answers = self.answer_forwards(steps)
            following = {}
            for row, step in steps.items():
                call, out = calls[row], drafted[row]
                (answer,) = answers[row]
                if isinstance(answer, int):  # tokens only
                    token = answer
                else:
                    token = answer.argmax if call.sampler is None else call.sampler.sample(answer)
                    out.rows.append(answer)
                out.tokens.append(token)
                if len(out.tokens) < call.n and token not in call.stop_ids:
                    following[row] = DraftStep(step.member, step.keep + len(step.ids), [token], [0], call)
            steps = following
        return drafted

    def draft_on_device(self, calls: dict[int, Draft]) -> dict[int, Drafted]:
        """Greedy drafts with one read-back per window: each step feeds the argmax the step
        before it left on the device (:attr:`~.heads.CutHeads.tokens`), so a GPU's host queues
        the whole window without waiting for it, and the window's heads come back in one copy
        at its end (:func:`~.heads.read_cuts`). A row drafts its ``n`` tokens whatever they
        are; the tokens after its first stop id are dropped from the answer (the next call's
        ``keep`` crops them from the cache; at batch size one they cost up to ``n - 1`` extra
        forwards once a request, where reading every token cost a wait on every one)."""
        steps = {row: DraftStep(c.member, c.keep, c.ids, [len(c.ids) - 1], c) for row, c in calls.items()}
        drawn = dict.fromkeys(calls, 0)
        window: list[tuple[CutHeads, list[list[int]]]] = []
        fed: torch.Tensor | None = None
        while steps:
            parts, owners = self.forward(steps, fed)
            cut = heads.cut_heads(parts, exact_tokens=True)
            window.append((cut, owners))
            position = {row: i for i, row in enumerate(row for part in owners for row in part)}
            following = {}
            for row, step in steps.items():
                drawn[row] += 1
                if drawn[row] < calls[row].n:
                    pad = [step.ids[-1]]  # a placeholder: the fed id is on the device
                    following[row] = DraftStep(
                        step.member, step.keep + len(step.ids), pad, [0], calls[row], position[row]
                    )
            fed, steps = cut.tokens, following
        drafted = {row: Drafted([], []) for row in calls}
        for (_, owners), answers in zip(window, heads.read_cuts([cut for cut, _ in window]), strict=True):
            for rows, part_owners in zip(answers, owners, strict=True):
                for answer, row in zip(rows, part_owners, strict=True):
                    out = drafted[row]
                    if out.tokens and out.tokens[-1] in calls[row].stop_ids:
                        continue  # drafted past a stop id
                    if isinstance(answer, int):  # tokens only
                        out.tokens.append(answer)
                    else:
                        out.tokens.append(answer.argmax)
                        out.rows.append(answer)
        return drafted
