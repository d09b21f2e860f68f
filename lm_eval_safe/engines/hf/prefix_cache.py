"""Shared-prefix KV reuse across requests: one member's states of recently prefilled prompts.

Few-shot tasks repeat the same exemplars in every request (every BBH subtask, lm-eval's
``--num_fewshot``, a chat system prompt): thousands of tokens that each member would prefill
again for every question. A :class:`PrefixStore` keeps the keys and values of prompts a member
has prefilled, in blocks of :data:`BLOCK` token ids chained like a trie (a block is keyed by
its ids *and* the block before it), so the exemplars shared by many prompts are stored once and
a new prompt starts from the longest run of whole blocks it shares with any earlier one.

Each member keys by its own token ids: a prefix shared in text but tokenized differently at
the seam simply matches up to the last block the ids agree on. The states of a token depend
only on the tokens before it, so a reused prefix gives the same states as prefilling it again
(up to float rounding of a differently shaped product); outputs do not depend on what the store
holds. The store is bounded by a byte budget: least recently used blocks are evicted first,
always a block no other stored block continues, so every stored chain stays whole.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from lm_eval_safe.engines.hf import kv_cache, packed_slots

logger = logging.getLogger(__name__)

BLOCK = 16


@dataclass(eq=False)
class _Block:
    serial: int
    parent: _Block | None
    ids: tuple[int, ...]
    states: packed_slots.PackedSlots
    children: int = 0
    used: int = 0


@dataclass
class PrefixStore:
    """Keys and values of prompt prefixes one member has prefilled, bounded by ``budget`` bytes."""

    budget: int
    block: int = BLOCK
    bytes: int = 0
    looked_up_tokens: int = 0  # prompt tokens of every lookup
    reused_tokens: int = 0  # of those, tokens whose states came from the store
    _blocks: dict[tuple[int, tuple[int, ...]], _Block] = field(default_factory=dict, repr=False)
    _clock: Any = field(default_factory=itertools.count, repr=False)
    _serials: Any = field(default_factory=lambda: itertools.count(1), repr=False)

    def __len__(self) -> int:
        return len(self._blocks)

    def _chain(self, ids: list[int], limit: int) -> list[_Block]:
        """Stored blocks that spell ``ids`` from the start, covering at most ``limit`` tokens."""
        chain: list[_Block] = []
        parent = 0
        for start in range(0, limit - self.block + 1, self.block):
            found = self._blocks.get((parent, tuple(ids[start : start + self.block])))
            if found is None:
                break
            chain.append(found)
            parent = found.serial
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        now = next(self._clock)
        for stored in chain:
            stored.used = now

    def longest(self, ids: list[int], limit: int | None = None) -> int:
        """Length of the prefix :meth:`lookup` would reuse (nothing is counted or touched)."""
        limit = len(ids) - 1 if limit is None else min(limit, len(ids))
        return len(self._chain(ids, limit)) * self.block

    def lookup(self, ids: list[int], limit: int | None = None) -> tuple[int, Any]:
        """``(n, cache)``: a new cache holding the states of the longest stored prefix of ``ids``
        that is at most ``limit`` tokens long (default: all but the last token, which must be
        fed to get its next-token distribution), and its length ``n`` (0: an empty cache)."""
        limit = len(ids) - 1 if limit is None else min(limit, len(ids))
        self.looked_up_tokens += len(ids)
        chain = self._chain(ids, limit)
        if not chain:
            return 0, kv_cache.new_cache()
        self._touch(chain)
        states = packed_slots.concat_slots([stored.states for stored in chain])
        reused = len(chain) * self.block
        self.reused_tokens += reused
        return reused, kv_cache.new_cache(states)

    def add(self, ids: list[int], cache: Any, row: int = 0, offset: int = 0) -> None:
        """Store the whole blocks of ``ids``, whose states sit in batch row ``row`` of ``cache``
        at slots ``offset .. offset + len(ids) - 1`` (copies: the cache may change later)."""
        if self.budget <= 0:
            return
        parent: _Block | None = None
        chain = []
        starts = range(0, len(ids) - self.block + 1, self.block)
        # a new block's serial is new, so every block after it is new too: they are packed
        # together at the first one
        new: list[packed_slots.PackedSlots] = []
        first_new = 0
        for n, start in enumerate(starts):
            key = (parent.serial if parent else 0, tuple(ids[start : start + self.block]))
            stored = self._blocks.get(key)
            if stored is None:
                if not new:
                    packer = packed_slots.RowPacker(cache)
                    new, first_new = packer.pack_blocks(row, offset + start, self.block, len(starts) - n), n
                states = new[n - first_new]
                stored = _Block(next(self._serials), parent, key[1], states)
                self._blocks[key] = stored
                self.bytes += states.nbytes
                if parent is not None:
                    parent.children += 1
            chain.append(stored)
            parent = stored
        self._touch(chain)
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used blocks until the store fits its budget. Only a block that no
        other block continues (a leaf) goes; a parent whose last child went becomes a leaf and
        competes by its own last use (never older than its children's)."""
        if self.bytes <= self.budget:
            return
        leaves = [(b.used, b.serial, b) for b in self._blocks.values() if b.children == 0]
        heapq.heapify(leaves)
        while self.bytes > self.budget and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del self._blocks[(parent.serial if parent else 0, leaf.ids)]
            self.bytes -= leaf.states.nbytes
            if parent is not None:
                parent.children -= 1
                if parent.children == 0:
                    heapq.heappush(leaves, (parent.used, parent.serial, parent))
