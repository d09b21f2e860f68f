"""A prefix store's blocks: slots of one cache row, every layer packed into few tensors (one
of the modules that know transformers' caches; :mod:`.kv_cache` holds the caches themselves)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lm_eval_safe.engines.hf.kv_cache import LayerStates, layer_states


@dataclass(frozen=True)
class PackedSlots:
    """Slots ``begin:end`` of one row of every layer, packed: the keys and values of all layers
    that share a device, dtype and shape are one tensor ``[tensors, 1, heads, slots, dim]``.

    Why: a prefix store copies a prompt's states out one block at a time and copies a chain of
    blocks back in for a later prompt. Per layer that is two kernels per block (a 30-layer member
    launches 60 to store 16 tokens), a cost a GPU's host pays per launch; packed it is one per
    group of equal tensors, usually one for the whole model."""

    packs: tuple[torch.Tensor, ...]
    #: per layer: the (pack, index) of its keys and of its values, or None for an empty layer
    places: tuple[tuple[tuple[int, int], tuple[int, int]] | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packs)

    def layers(self) -> list[LayerStates]:
        """Per layer, views of its keys and values (``[1, heads, slots, dim]``)."""
        return [
            None if place is None else (self.packs[place[0][0]][place[0][1]], self.packs[place[1][0]][place[1][1]])
            for place in self.places
        ]


class RowPacker:
    """Packs slots of a cache's rows (:class:`PackedSlots`), its layers grouped once: a prompt's
    blocks are packed one after another, and the groups and places depend on the layers'
    devices, dtypes and shapes only, which the blocks share."""

    def __init__(self, cache: Any) -> None:
        self.states = layer_states(cache)
        kinds: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        places: list[tuple[tuple[int, int], tuple[int, int]] | None] = []
        for states in self.states:
            if states is None:
                places.append(None)
                continue
            place = []
            for tensor in states:
                kind = (tensor.device, tensor.dtype, tensor.shape[1], tensor.shape[3])
                group = kinds.setdefault(kind, [])
                place.append((list(kinds).index(kind), len(group)))
                group.append(tensor)
            places.append((place[0], place[1]))
        self.groups = list(kinds.values())
        self.places = tuple(places)

    def pack(self, row: int, begin: int, end: int) -> PackedSlots:
        """Copies of slots ``begin:end`` of ``row``, every layer (kept while the cache changes)."""
        return self.pack_blocks(row, begin, end - begin, 1)[0]

    def pack_blocks(self, row: int, begin: int, block: int, count: int) -> list[PackedSlots]:
        """``count`` consecutive blocks of ``block`` slots of ``row`` from ``begin`` on, each
        packed on its own (a block is evicted alone): every layer is cut into its blocks by one
        ``split``, then one ``stack`` per group copies each block."""
        end = begin + block * count
        blocks_of = [[t[row : row + 1, :, begin:end].split(block, dim=2) for t in group] for group in self.groups]
        return [
            PackedSlots(tuple(torch.stack([pieces[k] for pieces in group]) for group in blocks_of), self.places)
            for k in range(count)
        ]


def pack_row_slots(cache: Any, row: int, begin: int, end: int) -> PackedSlots:
    """Copies of slots ``begin:end`` of one row, every layer (kept while the cache changes)."""
    return RowPacker(cache).pack(row, begin, end)


def concat_slots(chunks: Sequence[PackedSlots]) -> list[LayerStates]:
    """Per layer, the states of consecutive chunks (:func:`pack_row_slots` results of one
    model) concatenated along the slots: one copy per pack."""
    places = chunks[0].places
    if any(chunk.places != places for chunk in chunks):
        raise ValueError("concat_slots joins the packed slots of one model only")
    packs = zip(*(chunk.packs for chunk in chunks), strict=True)
    return PackedSlots(tuple(torch.cat(parts, dim=3) for parts in packs), places).layers()
