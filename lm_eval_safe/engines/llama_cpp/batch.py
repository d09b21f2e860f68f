"""One llama.cpp member's rows in a generation batch: each row is a sequence (a slot,
:mod:`.slots`) of the member's context, kept across calls. A call's ``keep`` rolls the slot
back (``llama_memory_seq_rm``) to what stays; only the ids after it are fed, with logits asked
at the positions read. A draft step feeds one id per drafting row.

Rows are full log-softmax rows over the tokenizer's ids (as the transformers engine computes
them), so every decision is exact and the decoder never asks for :class:`Complete`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lm_eval_safe.engines.base import Complete, Draft, Drafted, EngineBatch, Forward
from lm_eval_safe.engines.llama_cpp.slots import Feed


@dataclass
class _Row:
    sequence: list[int] = field(default_factory=list)
    slot: int | None = None


class LlamaCppBatch(EngineBatch):
    #: a row's forwards before its drafts (a verifier window, then the next draft)
    answer_order = (Forward, Draft, Complete)
    engine_title = "llama.cpp"

    def __init__(self, engine: Any):
        self.engine = engine
        self.rows: list[_Row] = []

    def add_row(self) -> int:
        self.rows.append(_Row())
        return len(self.rows) - 1

    def keep_rows(self, rows: list[int]) -> None:
        kept = set(rows)
        for index, row in enumerate(self.rows):
            if index not in kept and row.slot is not None:
                self.engine.slots.give_back(row.slot)
        self.rows = [self.rows[r] for r in rows]

    def close(self) -> None:
        self.keep_rows([])

    def __del__(self) -> None:
        # at interpreter shutdown the modules this needs may already be gone (even contextlib)
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    def answer_completes(self, calls: dict[int, Complete]) -> dict[int, list[Any]]:
        raise RuntimeError("llama.cpp rows are full distributions: nothing to complete")

    def _feed(self, row: int, keep: int, ids: list[int], want: list[int]) -> Feed:
        """The row's sequence becomes its first ``keep`` ids and ``ids``; its slot is rolled
        back to the longest prefix it (or another slot) holds before the first position read."""
        state = self.rows[row]
        if keep > len(state.sequence):
            raise RuntimeError(f"row {row} holds {len(state.sequence)} ids, cannot keep {keep}")
        state.sequence = state.sequence[:keep] + list(ids)
        slots = self.engine.slots
        new = state.slot is None
        if state.slot is None:
            state.slot = slots.take(state.sequence)
        start = slots.prepare(state.slot, state.sequence, min(want), new=new)
        return Feed(state.slot, start, state.sequence[start:], want)

    def _decode(self, asks: list[tuple[int, int, list[int], list[int]]]) -> list[torch.Tensor]:
        """Each ``(row, keep, ids, want)``'s logits at ``want``. Rows decoded apart are fed one
        after another, each made ready just before its decode, so a new row reuses the blocks a
        row before it in the same step has just computed (rows sharing few-shot exemplars).
        With ``batch_rows`` the rows' steps go in one decode, but a new row's prompt still goes
        on its own first: in one decode, 8 rows sharing 3-shot exemplars would each compute
        them."""
        slots = self.engine.slots
        if not slots.batch_rows:
            return [slots.decode([self._feed(*ask)])[0] for ask in asks]
        out = {
            i: slots.decode([self._feed(*ask)])[0]
            for i, ask in enumerate(asks)
            if self.rows[ask[0]].slot is None
        }
        rest = [i for i in range(len(asks)) if i not in out]
        if rest:
            out.update(zip(rest, slots.decode([self._feed(*asks[i]) for i in rest]), strict=True))
        return [out[i] for i in range(len(asks))]

    def answer_forwards(self, calls: dict[int, Forward]) -> dict[int, list[torch.Tensor]]:
        asks, order = [], []
        for row, call in calls.items():
            want = [call.keep + w for w in call.want]
            # nothing read: the ids are fed all the same (the cache is kept)
            want_read = want or [call.keep + len(call.ids) - 1]
            asks.append((row, call.keep, call.ids, want_read))
            order.append((row, bool(want)))
        logits = self._decode(asks)
        out: dict[int, list[torch.Tensor]] = {}
        for (row, any_wanted), rows in zip(order, logits, strict=True):
            out[row] = list(self.engine.log_softmax(rows)) if any_wanted else []
        return out

    def answer_drafts(self, calls: dict[int, Draft]) -> dict[int, Drafted]:
        engine = self.engine
        drafted = {row: Drafted([], []) for row in calls}
        steps = {
            row: (call.keep, call.ids) for row, call in calls.items()
        }
        while steps:
            logits = self._decode([(row, keep, ids, [keep + len(ids) - 1]) for row, (keep, ids) in steps.items()])
            following = {}
            for (row, (keep, ids)), rows in zip(steps.items(), logits, strict=True):
                call, out = calls[row], drafted[row]
                if call.sampler is None and not call.rows:
                    token = engine.argmax(rows[0])
                else:
                    full = engine.log_softmax(rows)[0]
                    token = int(torch.argmax(full)) if call.sampler is None else call.sampler.sample(full)
                    out.rows.append(full)
                out.tokens.append(token)
                if len(out.tokens) < call.n and token not in call.stop_ids:
                    following[row] = (keep + len(ids), [token])
                else:  # the row's sequence holds the drafted token, not yet fed
                    state = self.rows[row]
                    state.sequence = state.sequence + [token]
            steps = following
        return drafted
