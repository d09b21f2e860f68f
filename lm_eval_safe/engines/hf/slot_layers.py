"""The layers of a batch's KV cache (:mod:`.kv_cache` makes and moves them): keys and values
in buffers with spare rows and slots, written in place, and the moves between them batched over
every layer.

Why a module of their own: :mod:`.kv_cache` holds what a cache is to transformers (its layers,
crops, rows); these are the buffers behind a batch's layers, whose every move (a row spliced
in, rows dropped, a compaction) is queued in :class:`Moves` and run as one ``torch._foreach_*``
call for all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class Moves:
    """The copies and zero fills of one cache operation over every layer, run as one
    ``torch._foreach_*`` call each: a batch's cache moves once per operation, not once per
    layer (a 30-layer member's row splice was 60 launches on a GPU and 60 dispatches from
    Python on any device)."""

    def __init__(self) -> None:
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.zeros: list[torch.Tensor] = []

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.targets.append(target)
        self.sources.append(source)

    def zero(self, target: torch.Tensor) -> None:
        self.zeros.append(target)

    def run(self) -> None:
        if self.targets:
            torch._foreach_copy_(self.targets, self.sources)
        if self.zeros:
            torch._foreach_zero_(self.zeros)
        self.targets, self.sources, self.zeros = [], [], []


class SlotLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in buffers ``[row capacity, heads, slot
    capacity, dim]`` with spare rows and slots after the ones held: a forward's new slots, a
    batch's appended slots, a crop, a row added or dropped cost no copy of the slots already
    held (the buffers are re-allocated only when they fill up, growing by a quarter at least).
    Assigning ``keys``/``values`` adopts the tensor as the buffer.

    Keys and values keep their own extent (rows, slots held): transformers assigns them one
    after the other, and each must read as the tensor it was until its own assignment."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._extent = [(0, 0), (0, 0)]  # (rows, slots) held by keys and by values
        self._peak_rows = 0  # the most rows held at once: a refill after a shrink grows back to it
        super().__init__()

    @classmethod
    def holding(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        spare: int,
        rows: int | None = None,
        moves: Moves | None = None,
        row: int | None = None,
    ) -> SlotLayer:
        """A layer holding copies of ``keys``/``values`` with ``spare`` slots after them;
        ``rows``: that many rows, each a copy of the states' single row, or with ``row``, that
        row alone a copy and the others zeros (holes). ``moves``: the copies join those of the
        other layers (run by the caller), else they run at once."""
        own = moves is None
        moves = Moves() if moves is None else moves
        layer = cls()
        layer.device = keys.device
        layer.is_initialized = True
        if rows is not None and row is not None:
            slots = keys.shape[2]
            layer._buffers = []
            for states in (keys, values):
                out = states.new_empty((rows, states.shape[1], slots + spare, states.shape[3]))
                moves.copy(out[row, :, :slots], states[0])
                moves.zero(out[:row, :, :slots])
                moves.zero(out[row + 1 :, :, :slots])
                layer._buffers.append(out)
        else:
            if rows is not None:
                keys, values = keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)
            layer._buffers = [with_spare(keys, spare, moves), with_spare(values, spare, moves)]
        if own:
            moves.run()
        held_rows = keys.shape[0] if rows is None else rows
        layer._extent = [(held_rows, keys.shape[2]), (held_rows, values.shape[2])]
        layer._peak_rows = held_rows
        return layer

    def _view(self, which: int) -> torch.Tensor | None:
        buffer = self._buffers[which]
        rows, slots = self._extent[which]
        return None if buffer is None else buffer[:rows, :, :slots]

    def _adopt(self, which: int, tensor: torch.Tensor | None) -> None:
        self._buffers[which] = tensor
        if tensor is not None:
            self._extent[which] = (tensor.shape[0], tensor.shape[2])

    keys = property(lambda self: self._view(0), lambda self, t: self._adopt(0, t))
    values = property(lambda self: self._view(1), lambda self, t: self._adopt(1, t))

    def _held(self) -> tuple[list[torch.Tensor], int, int]:
        """Both buffers and the extent they share (outside a transformers assignment)."""
        keys, values = self._buffers
        if keys is None or values is None or self._extent[0] != self._extent[1]:
            raise RuntimeError("a SlotLayer's keys and values hold different extents")
        return [keys, values], *self._extent[0]

    def _reallocate(
        self, rows: int, slots: int, row_capacity: int, slot_capacity: int, moves: Moves, offset: int = 0
    ) -> None:
        """New buffers; the ``rows x slots`` held are copied to slot ``offset`` on (by
        ``moves``: the old buffers live on in its sources until it runs)."""
        buffers, _, _ = self._held()
        fresh = []
        for buffer in buffers:
            out = buffer.new_empty((row_capacity, buffer.shape[1], slot_capacity, buffer.shape[3]))
            moves.copy(out[:rows, :, offset : offset + slots], buffer[:rows, :, :slots])
            fresh.append(out)
        self._buffers = fresh

    def reserve(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hold ``width`` more slots; returns them (keys, values) for the caller to fill."""
        buffers, rows, held = self._held()
        if held + width > buffers[0].shape[2]:
            spare = max(width, 64, held // 4)
            moves = Moves()
            self._reallocate(rows, held, buffers[0].shape[0], held + width + spare, moves)
            moves.run()
        self._extent = [(rows, held + width)] * 2
        keys, values = self._buffers
        assert keys is not None and values is not None
        return keys[:rows, :, held : held + width], values[:rows, :, held : held + width]

    def crop_to(self, length: int) -> None:
        self._extent = [(rows, min(held, length)) for rows, held in self._extent]

    def add_rows(self, count: int, moves: Moves) -> None:
        """``count`` rows of zeros (holes: finite values the masks exclude) after the others.
        Buffers that must grow take the most rows ever held at once, so the requests that refill
        a batch after :meth:`keep_rows` shrank it cost one re-allocation, not one each."""
        buffers, rows, held = self._held()
        self._peak_rows = max(self._peak_rows, rows + count)
        if rows + count > buffers[0].shape[0]:
            self._reallocate(rows, held, self._peak_rows, buffers[0].shape[2], moves)
        for buffer in self._buffers:
            assert buffer is not None
            moves.zero(buffer[rows : rows + count, :, :held])
        self._extent = [(rows + count, held)] * 2

    def keep_rows(self, kept: Sequence[int], moves: Moves, back: Moves) -> None:
        """Row ``i`` becomes the listed ``kept[i]``: only rows not already in their place are
        copied, straight into it by ``moves`` where every source lies past the rows kept (the
        batch driver's order), else through a scratch tensor (out by ``moves``, back by
        ``back``, run after it: sources and targets overlap). Once half the row capacity or
        less is kept (a run's last requests, with none left to admit), the buffers shrink to
        the rows kept, so finished rows' memory is given back as it was when rows were copied
        out."""
        buffers, _, held = self._held()
        if len(kept) <= buffers[0].shape[0] // 2:
            # new buffers, each kept row copied into its place (the old buffers are only read)
            fresh = []
            for buffer in buffers:
                out = buffer.new_empty((len(kept), buffer.shape[1], buffer.shape[2], buffer.shape[3]))
                for target, row in enumerate(kept):
                    moves.copy(out[target, :, :held], buffer[row, :, :held])
                fresh.append(out)
            self._buffers = fresh
            self._extent = [(len(kept), held)] * 2
            return
        moved = [(target, row) for target, row in enumerate(kept) if row != target]
        direct = all(row >= len(kept) for _, row in moved)
        for buffer in buffers:
            if direct:
                for target, row in moved:
                    moves.copy(buffer[target, :, :held], buffer[row, :, :held])
                continue
            scratch = buffer.new_empty((len(moved), buffer.shape[1], held, buffer.shape[3]))
            for out, (target, row) in enumerate(moved):
                moves.copy(scratch[out], buffer[row, :, :held])
                back.copy(buffer[target, :, :held], scratch[out])
        self._extent = [(len(kept), held)] * 2

    def widen_left(self, grow: int, moves: Moves) -> None:
        """``grow`` slots of zeros before every row's slots."""
        buffers, rows, held = self._held()
        spare = buffers[0].shape[2] - held
        self._reallocate(rows, held, buffers[0].shape[0], grow + held + spare, moves, offset=grow)
        for buffer in self._buffers:
            assert buffer is not None
            moves.zero(buffer[:rows, :, :grow])
        self._extent = [(rows, grow + held)] * 2

    def compact_slots(
        self, begin: int, runs: Sequence[Sequence[tuple[int, int, int]]], width: int, moves: Moves, back: Moves
    ) -> None:
        """Each row's slots from ``begin`` on become ``width`` slots: its runs ``(source slot,
        target slot counted from begin, length)`` copied out, zeros in the rest. The copies go to a
        scratch tensor first (``moves``) and come back by ``back``, run after it, as a run may
        move right over slots another run still has to read. A compaction of every slot
        (``begin`` 0: slots left before every row's first token by rows that finished) writes
        into new buffers instead, each slot copied once rather than out and back."""
        buffers, rows, held = self._held()
        fresh = []
        for buffer in buffers:
            if begin == 0:
                scratch = buffer.new_empty(buffer.shape)
                fresh.append(scratch)
            else:
                scratch = buffer.new_empty((rows, buffer.shape[1], width, buffer.shape[3]))
            for row, row_runs in enumerate(runs):
                filled = 0
                for source, target, length in row_runs:
                    moves.zero(scratch[row, :, filled:target])
                    moves.copy(scratch[row, :, target : target + length], buffer[row, :, source : source + length])
                    filled = target + length
                moves.zero(scratch[row, :, filled:width])
            if begin > 0:
                back.copy(buffer[:rows, :, begin : begin + width], scratch)
        if fresh:
            self._buffers = fresh
        self._extent = [(rows, begin + width)] * 2

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            empty = key_states[:, :, :0]
            layer = SlotLayer.holding(empty, value_states[:, :, :0], key_states.shape[2])
            self.device, self.is_initialized = layer.device, True
            self._buffers, self._extent = layer._buffers, layer._extent
        keys, values = self.reserve(key_states.shape[2])
        keys.copy_(key_states)
        values.copy_(value_states)
        return self.keys, self.values  # type: ignore[return-value]


class RowsLayer(DynamicLayer):
    """Some rows of a batch's :class:`SlotLayer`, for one forward of those rows alone (a
    verifier scoring the windows of a few requests of a batch). A forward's new slots are
    written into the batch's buffers in place, holes (zeros) for the other rows as a forward of
    every row leaves them, and attention reads a gather of the rows' slots, made once per layer
    and forward: the rows' states are read once, where copying them out (into buffers with
    spare slots) and the new slots back read and wrote them twice, and allocated the copies
    anew at every call. Transformers reads a layer's length through ``get_seq_length`` (4.57
    and 5.x), answered here without a gather."""

    def __init__(self, batch_layer: SlotLayer, rows: torch.Tensor) -> None:
        self._batch_layer = batch_layer
        self._rows = rows
        super().__init__()
        self.device = batch_layer.device
        self.is_initialized = True

    def _gather(self, which: int) -> torch.Tensor:
        buffers, rows, held = self._batch_layer._held()
        return buffers[which][:rows, :, :held].index_select(0, self._rows)

    # transformers' constructor assigns None; the states themselves live in the batch layer
    keys = property(lambda self: self._gather(0), lambda self, _: None)
    values = property(lambda self: self._gather(1), lambda self, _: None)

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self._batch_layer._held()[2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for slots, new in zip(self._batch_layer.reserve(key_states.shape[2]), (key_states, value_states), strict=True):
            slots.zero_()
            slots.index_copy_(0, self._rows, new)
        return self._gather(0), self._gather(1)


def with_spare(tensor: torch.Tensor, spare: int, moves: Moves) -> torch.Tensor:
    out = tensor.new_empty((*tensor.shape[:2], tensor.shape[2] + spare, tensor.shape[3]))
    moves.copy(out[:, :, : tensor.shape[2]], tensor)
    return out


# -- caches -----------------------------------------------------------------------------------


def runs(slots: Sequence[int], target: int) -> list[tuple[int, int, int]]:
    """``(source, target, length)`` runs of consecutive ``slots`` written from ``target`` on."""
    runs: list[tuple[int, int, int]] = []
    for slot in slots:
        if runs and runs[-1][0] + runs[-1][2] == slot:
            source, start, length = runs[-1]
            runs[-1] = (source, start, length + 1)
        else:
            runs.append((slot, target, 1))
        target += 1
    return runs
