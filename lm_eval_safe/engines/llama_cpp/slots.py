"""A member's KV cache as ``n_seq_max`` sequences (slots) of one llama.cpp context, each holding
the ids it was last fed.

A row (of a generation batch, or a scored continuation) takes a free slot when it first feeds
ids: the slot whose ids share the longest prefix with its sequence, the rest rolled back with
``llama_memory_seq_rm``; where another slot (busy or not) shares a longer prefix, its cells are
copied (``llama_memory_seq_cp``: the unified cache shares them, nothing is recomputed). A slot
given back keeps its ids until another row needs it, so a prompt prefix outlives the request
that computed it (few-shot exemplars, a chat template's system turn).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lm_eval_safe.engines.llama_cpp.native import DecodeError, Model


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Feed:
    """One slot's part of a decode: ``ids`` fed from position ``start``; logits after the
    positions in ``want`` (absolute positions, each in ``[start, start + len(ids))``)."""

    slot: int
    start: int
    ids: list[int]
    want: list[int]


class Slots:
    def __init__(self, model: Model, together: bool):
        self.model = model
        n = model.settings.n_seq_max
        self.cached: list[list[int]] = [[] for _ in range(n)]
        self.busy = [False] * n
        #: whether the rows of one decode go in one ``llama_decode``, each row's ids in one
        #: (:func:`lm_eval_safe.engines.llama_cpp.probe.rows_agree` decides at load time). Where
        #: a model's logits depend on how its ids are split into decodes, every id is decoded
        #: on its own (one ``llama_decode`` per id and row): each position is then computed the
        #: same way whatever the schedule, the batch or the prefix copied, as in a generation
        #: with ``n_batch=1``; and each sequence has a KV stream of its own
        #: (:meth:`~lm_eval_safe.engines.llama_cpp.native.Model.separate_streams`), so its cells
        #: follow its positions whatever other rows freed.
        self.together = together
        self.looked_up = 0  # ids a row asked to hold (prefill counts)
        self.reused = 0  # of those, read from a slot's cells

    @property
    def free(self) -> int:
        return self.busy.count(False)

    def take(self, sequence: Sequence[int]) -> int:
        """A free slot for a row whose sequence starts with ``sequence`` (its longest cached
        prefix first; the emptiest on a tie)."""
        free = [s for s in range(len(self.busy)) if not self.busy[s]]
        if not free:
            raise RuntimeError(
                f"every one of llama.cpp's {len(self.busy)} sequences is in use: give a larger "
                "n_seq_max= or a smaller batch_size="
            )
        slot = max(free, key=lambda s: (common_prefix(self.cached[s], sequence), -len(self.cached[s])))
        self.busy[slot] = True
        return slot

    def give_back(self, slot: int) -> None:
        self.busy[slot] = False

    def prepare(self, slot: int, sequence: Sequence[int], first: int, prompt: bool = False) -> int:
        """Make ``slot`` hold a prefix of ``sequence`` no longer than ``first`` (the first
        position whose logits are read must be fed again); returns that prefix's length.
        ``prompt``: the row's first ids (counted as prompt ids looked up, and those reused)."""
        held = common_prefix(self.cached[slot], sequence)
        best, source = held, slot
        for other, ids in enumerate(self.cached):
            if other != slot:
                shared = common_prefix(ids, sequence)
                if shared > best:
                    best, source = shared, other
        keep = min(best, first)
        if source != slot and keep > held:
            self.model.copy(source, slot, keep)
        else:
            keep = min(held, first)
            if keep < len(self.cached[slot]):
                self.model.remove(slot, keep)
        self.cached[slot] = list(sequence[:keep])
        if prompt:
            self.looked_up += len(sequence)
            self.reused += keep
        return keep

    def decode(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """Run every feed (one ``llama_decode`` for all, or one per feed when rows are kept
        apart) and return each feed's logits at its ``want`` positions (``[k, n_vocab]``).
        A batch that finds no free KV cells is tried again after the cells of slots no row
        holds are freed."""
        for attempt in range(2):
            try:
                return self._decode(feeds)
            except DecodeError as exc:
                for feed in feeds:  # a failed decode may leave some of its chunks behind
                    self.model.remove(feed.slot, feed.start)
                    self.cached[feed.slot] = self.cached[feed.slot][: feed.start]
                if exc.code != 1 or attempt == 1 or not self.forget():
                    cells = (
                        f"{self.model.n_ctx} ids in all, shared by its sequences"
                        if self.model.unified
                        else f"{self.model.n_ctx} ids for each sequence"
                    )
                    raise RuntimeError(
                        f"llama.cpp has no KV cells left for this batch ({cells}): give a larger "
                        "n_ctx= or a smaller batch_size="
                    ) from exc
        raise AssertionError("unreachable")

    def forget(self) -> bool:
        """Forget the ids of every slot no row holds; whether any were forgotten."""
        freed = False
        for slot, busy in enumerate(self.busy):
            if not busy and self.cached[slot]:
                self.model.remove(slot, 0)
                self.cached[slot] = []
                freed = True
        return freed

    def _decode(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        if not self.together:
            return [self._one_by_one(feed) for feed in feeds]
        groups: Iterable[Sequence[Feed]] = [feeds]
        out: list[torch.Tensor] = []
        for group in groups:
            entries = [
                (token, feed.start + i, feed.slot, feed.start + i in wanted)
                for feed in group
                for wanted in [set(feed.want)]
                for i, token in enumerate(feed.ids)
            ]
            logits = self.model.decode(entries)
            at = 0
            for feed in group:
                k = len(set(feed.want))
                rows = logits[at : at + k]
                at += k
                order = sorted(set(feed.want))
                index = [order.index(p) for p in feed.want]
                out.append(rows[index])
                self.cached[feed.slot].extend(feed.ids)
        return out

    def _one_by_one(self, feed: Feed) -> torch.Tensor:
        """A feed as one ``llama_decode`` per id."""
        wanted = set(feed.want)
        rows: dict[int, torch.Tensor] = {}
        for i, token in enumerate(feed.ids):
            position = feed.start + i
            logits = self.model.decode([(token, position, feed.slot, position in wanted)])
            self.cached[feed.slot].append(token)
            if position in wanted:
                rows[position] = logits[0]
        return torch.stack([rows[p] for p in feed.want])
