"""The rows of one member's batched KV cache: per-row lengths and rollback without re-packing.

SAFE rolls each request back on its own (the drafter after a rejection, a verifier when its
re-tokenization changes the last tokens), so rows of a batch never have one common length.
Instead of re-packing the cache on every rollback, a row's rolled-back slots become *holes*:
every cache slot carries the real position of its token (or -1), and the attention mask is
built from those positions. Masks, rotary positions and sliding windows therefore see exactly
the sequence a lone request would see; holes and left padding only cost memory until the next
compaction.
"""

from __future__ import annotations

from typing import Any

import torch

from lm_eval_safe.engines.hf import kv_cache
from lm_eval_safe.members.member import Member

# Slots beyond the longest row that may hold holes before the cache is compacted: compaction
# copies the whole cache, like one forward's ``torch.cat`` does, so it must be rare.
_COMPACT_SLACK = 48

# Spare slots a batch's cache is given when it is made (kv_cache.SlotLayer): a generation's
# forwards then write into them instead of copying the cache on every step.
_SPARE_SLOTS = 64


class CacheRows:
    """One member's KV cache for the rows of a batch, with per-row lengths and rollback.

    ``positions[r, s]`` is the position in row ``r``'s sequence of the token cached in slot
    ``s``, or -1 for a hole or padding. Row ``r`` holds positions ``0 .. lengths[r] - 1``.
    """

    def __init__(self, member: Member):
        self.member = member
        self.cache: Any = None
        self.positions = torch.empty((0, 0), dtype=torch.long)
        self.lengths: list[int] = []
        self._trimmed = True  # no trailing slot that no row uses (False after a rollback)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def slots(self) -> int:
        return self.positions.shape[1]

    def add_row(self) -> int:
        """An empty row at the end of the batch; returns its index."""
        self.lengths.append(0)
        pad = torch.full((1, self.slots), -1, dtype=torch.long)
        self.positions = torch.cat([self.positions, pad]) if self.rows > 1 else pad
        if self.cache is not None:
            kv_cache.add_rows(self.cache, 1)
        return self.rows - 1

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not listed (finished requests); row ``i`` becomes the listed
        ``rows[i]``."""
        if rows == list(range(self.rows)):
            return
        self.lengths = [self.lengths[r] for r in rows]
        index = torch.tensor(rows, dtype=torch.long)
        self.positions = self.positions[index]
        if self.cache is not None:
            if not rows:
                self.cache = None
                self.positions = torch.empty((0, 0), dtype=torch.long)
                return
            kv_cache.keep_rows(self.cache, rows)
        self._trim()

    def truncate(self, row: int, length: int) -> None:
        if length > self.lengths[row]:
            raise RuntimeError(
                f"row {row} of {self.member.name} holds {self.lengths[row]} tokens, cannot keep {length}"
            )
        if length < self.lengths[row]:
            self.positions[row][self.positions[row] >= length] = -1
            self.lengths[row] = length
            self._trimmed = False

    def _splice(self, row: int, cache: Any, length: int) -> None:
        """Put a lone sequence's cache into ``row``'s last slots (right-aligned), widening the
        batch's cache on the left when the sequence is longer than it."""
        self.lengths[row] = length
        if self.cache is None:  # the first prompt: the other rows are holes until their own come
            self.cache = kv_cache.with_slots(cache, _SPARE_SLOTS, rows=self.rows, row=row)
            self.positions = torch.full((self.rows, length), -1, dtype=torch.long)
            self.positions[row] = torch.arange(length)
            return
        grow = length - self.slots
        if grow > 0:
            self.positions = torch.cat(
                [torch.full((self.rows, grow), -1, dtype=torch.long), self.positions], dim=1
            )
            kv_cache.widen_left(self.cache, grow)
        start = self.slots - length
        self.positions[row] = -1
        self.positions[row, start:] = torch.arange(length)
        kv_cache.write_row(self.cache, row, start, cache)

    def _trim(self) -> None:
        """Crop trailing slots that no row uses (a lone row's rollback becomes a plain crop)."""
        if self.cache is None or self.slots == 0:
            return
        used = (self.positions >= 0).any(dim=0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else 0
        if keep < self.slots:
            kv_cache.crop(self.cache, keep)
            self.positions = self.positions[:, :keep]
        self._trimmed = True

    def _maybe_compact(self) -> None:
        """Compact the generated tail once its holes exceed :data:`_COMPACT_SLACK` slots: from
        the first slot where any row has a hole after its first token on, each row's tokens move
        right-aligned to the widest row's count (the prompts before it stay where they are).
        Slots before every row's first token (rows that left) are given back by compacting
        every slot, once they exceed the slack."""
        longest = max(self.lengths, default=0)
        # the tail's holes are at most slots - longest (the longest row fills the tail's width)
        if self.cache is None or self.slots <= longest + _COMPACT_SLACK:
            return
        live = self.positions >= 0
        holes = live.cummax(dim=1).values & ~live  # holes after a row's first token
        begin = int(torch.where(holes.any(dim=1), holes.int().argmax(dim=1), self.slots).min())
        # slots no row uses before every row's first token: left behind by rows that finished
        # (a refilled batch's newcomers are spliced at the end); past the slack, the whole cache
        # is compacted, so they never pile up
        lead = int(torch.where(live.any(dim=1), live.int().argmax(dim=1), self.slots).min())
        if lead > _COMPACT_SLACK:
            begin = 0
        tail = [(live[row, begin:]).nonzero().flatten() + begin for row in range(self.rows)]
        width = max(len(slots) for slots in tail)
        if self.slots - begin - width <= _COMPACT_SLACK:
            return
        positions = torch.full((self.rows, begin + width), -1, dtype=torch.long)
        positions[:, :begin] = self.positions[:, :begin]
        for row, slots in enumerate(tail):
            if slots.numel():
                positions[row, begin + width - slots.numel() :] = self.positions[row, slots]
        kv_cache.compact_slots(self.cache, begin, [slots.tolist() for slots in tail], width)
        self.positions = positions
