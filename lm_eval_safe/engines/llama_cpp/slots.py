"""A member's KV cache as ``n_seq_max`` sequences (slots) of one llama.cpp context, each holding
the ids it was last fed, and the one rule that keeps a row's distributions independent of its
batch and of what the cache held before.

On llama.cpp's CPU kernels a position's logits depend on how many ids its ``llama_decode``
holds (matrix products over one row and over several take other code paths, and so does flash
attention over 1, a few and 64 or more queries), so a row computes the same distributions
alone and in a batch only if its ids are cut into decodes the same way. Hence:

- each row's ids go in decodes of their own (``batch_rows=false``, the default), never shared
  with another row's;
- every feed is cut at the multiples of ``n_batch`` (absolute positions), so a prompt is
  computed in the same blocks whatever its first feed held;
- a new row reuses another request's cells (its slot's, or copied from another slot with
  ``llama_memory_seq_cp``) only for whole blocks ``[k * n_batch, (k + 1) * n_batch)`` that were
  computed in one piece from a block boundary (a slot's :attr:`Slots.canonical` length): the
  row alone computes exactly these blocks. A row's own rollback keeps any prefix it fed itself.

A slot given back keeps its ids until another row needs it, so a prompt prefix outlives the
request that computed it (few-shot exemplars, a chat template's system turn).

``batch_rows=true`` puts all rows of a step in one ``llama_decode`` and reuses any shared
prefix: faster at several rows, but a row's text then depends on its batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from lm_eval_safe.engines.llama_cpp.native import DecodeError, Model


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def blocks(start: int, end: int, size: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` cut at the multiples of ``size``."""
    at = start
    while at < end:
        stop = min(end, (at // size + 1) * size)
        yield at, stop
        at = stop


@dataclass
class Feed:
    """One slot's part of a decode: ``ids`` fed from position ``start``; logits after the
    positions in ``want`` (absolute positions, each in ``[start, start + len(ids))``)."""

    slot: int
    start: int
    ids: list[int]
    want: list[int]


class Slots:
    def __init__(self, model: Model, batch_rows: bool):
        self.model = model
        n = model.settings.n_seq_max
        self.cached: list[list[int]] = [[] for _ in range(n)]
        #: leading ids of each slot computed as whole blocks of ``block`` ids, each in one
        #: decode from a block boundary (a multiple of ``block``)
        self.canonical = [0] * n
        self.busy = [False] * n
        self.block = model.n_batch
        #: all rows of a step in one ``llama_decode`` (and any shared prefix reused)
        self.batch_rows = batch_rows
        self.looked_up = 0  # ids a new row asked to hold (prefill counts)
        self.reused = 0  # of those, read from a slot's cells

    @property
    def free(self) -> int:
        return self.busy.count(False)

    def take(self, sequence: Sequence[int]) -> int:
        """A free slot for a row whose sequence starts with ``sequence`` (the one it may reuse
        most of first; the emptiest on a tie)."""
        free = [s for s in range(len(self.busy)) if not self.busy[s]]
        if not free:
            raise RuntimeError(
                f"every one of llama.cpp's {len(self.busy)} sequences is in use: give a larger "
                "n_seq_max= or a smaller batch_size="
            )
        slot = max(free, key=lambda s: (self._reusable(s, sequence, len(sequence)), -len(self.cached[s])))
        self.busy[slot] = True
        return slot

    def give_back(self, slot: int) -> None:
        self.busy[slot] = False

    def _reusable(self, slot: int, sequence: Sequence[int], first: int) -> int:
        """How much of ``sequence`` a new row may read from ``slot``'s cells, at most ``first``."""
        shared = min(common_prefix(self.cached[slot], sequence), first)
        if self.batch_rows:
            return shared
        return min(shared, self.canonical[slot]) // self.block * self.block

    def prepare(self, slot: int, sequence: Sequence[int], first: int, new: bool = False) -> int:
        """Make ``slot`` hold a prefix of ``sequence`` no longer than ``first`` (the first
        position whose logits are read must be fed again); returns that prefix's length.
        ``new``: the row's first ids (another request's cells are read by the rule above;
        counted as prompt ids looked up, and those reused)."""
        if new:
            keep, source = self._reusable(slot, sequence, first), slot
            for other in range(len(self.cached)):
                if other != slot and (shared := self._reusable(other, sequence, first)) > keep:
                    keep, source = shared, other
            self.looked_up += len(sequence)
            self.reused += keep
        else:
            keep, source = min(common_prefix(self.cached[slot], sequence), first), slot
        if source != slot:
            self.model.copy(source, slot, keep)
            self.canonical[slot] = min(self.canonical[source], keep)
        elif keep < len(self.cached[slot]):
            self.model.remove(slot, keep)
            self.canonical[slot] = min(self.canonical[slot], keep // self.block * self.block)
        self.cached[slot] = list(sequence[:keep])
        return keep

    def decode(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """Run every feed and return each feed's logits at its ``want`` positions
        (``[k, n_vocab]``)."""
        try:
            if self.batch_rows:
                return self._together(feeds)
            return [self._apart(feed) for feed in feeds]
        except DecodeError as exc:
            for feed in feeds:  # a failed decode may leave some of its blocks behind
                self.model.remove(feed.slot, feed.start)
                self.cached[feed.slot] = self.cached[feed.slot][: feed.start]
                self.canonical[feed.slot] = min(self.canonical[feed.slot], feed.start // self.block * self.block)
            if exc.code == 1:
                said = f"; llama.cpp: {exc.words}" if exc.words else ""
                cells, n_ctx = self.model.cells_per_sequence, self.model.n_ctx
                padded = f", n_ctx={n_ctx} padded by llama.cpp" if cells != n_ctx else ""
                raise RuntimeError(
                    f"llama.cpp found no KV slot for this batch ({cells} cells for each "
                    f"sequence{padded}{said}): give a larger n_ctx="
                ) from exc
            raise RuntimeError(
                f"llama.cpp refused a decode: {exc}; the member's cache was rolled back to before "
                "it (report this with the words above where they do not say what to change)"
            ) from exc

    def forget(self) -> bool:
        """Forget the ids of every slot no row holds; whether any were forgotten."""
        freed = False
        for slot, busy in enumerate(self.busy):
            if not busy and self.cached[slot]:
                self.model.remove(slot, 0)
                self.cached[slot] = []
                self.canonical[slot] = 0
                freed = True
        return freed

    def _apart(self, feed: Feed) -> torch.Tensor:
        """A feed as decodes of its own, one per block it touches."""
        wanted = set(feed.want)
        rows: dict[int, torch.Tensor] = {}
        end = feed.start + len(feed.ids)
        for start, stop in blocks(feed.start, end, self.block):
            entries = [
                (feed.ids[p - feed.start], p, feed.slot, p in wanted) for p in range(start, stop)
            ]
            logits = self.model.decode(entries)
            read = [p for p in range(start, stop) if p in wanted]
            rows.update(zip(read, logits, strict=True))
            self.cached[feed.slot].extend(feed.ids[start - feed.start : stop - feed.start])
            if start == self.canonical[feed.slot] and stop - start == self.block:
                self.canonical[feed.slot] = stop
        if not feed.want:
            return torch.empty((0, self.model.n_vocab), dtype=torch.float32)
        return torch.stack([rows[p] for p in feed.want])

    def _together(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """Every feed in one ``llama_decode`` (cut in ``n_batch`` chunks)."""
        entries = [
            (token, feed.start + i, feed.slot, feed.start + i in wanted)
            for feed in feeds
            for wanted in [set(feed.want)]
            for i, token in enumerate(feed.ids)
        ]
        logits = self.model.decode(entries)
        out: list[torch.Tensor] = []
        at = 0
        for feed in feeds:
            order = sorted(set(feed.want))
            rows = logits[at : at + len(order)]
            at += len(order)
            out.append(rows[[order.index(p) for p in feed.want]])
            self.cached[feed.slot].extend(feed.ids)
        return out
