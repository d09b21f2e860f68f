"""transformers' KV caches, one of the three modules that know transformers' internals (with
:mod:`.model_calls`: the forward's cache keyword, masks, the output head; and
:mod:`.packed_slots`: a prefix store's blocks).

Batching, the prefix store and scoring all keep keys and values of one model across calls and
move rows of them around. Everything else in the package sees caches as opaque objects handed
to and from the functions of these modules, so a new transformers release touches them only (as
vLLM's ``KVCacheBlocks`` hides its manager's data structure from the scheduler).

Supported API generations (chosen once per model class or at import, by feature, never by a
default for an attribute that is missing):

- **Cache objects** (transformers 4.57 and 5.x alike): ``DynamicCache`` holds a list
  ``layers`` of ``DynamicLayer`` with tensors ``keys``/``values`` ``[rows, heads, slots, dim]``
  and a flag ``is_initialized``. What changed between the two generations is avoided, not
  branched on: ``lazy_initialization`` took ``(keys)`` in 4.57 and takes ``(keys, values)`` in
  5.x, ``DynamicCache(ddp_cache_data=...)`` accepts empty layers only in 5.x, and
  ``DynamicLayer.crop`` refuses a positive length in 5.x. Here layers are filled with
  ``update(keys, values)`` (the same in both) and cropped by slicing the tensors. Any layer of
  another class (a sliding-window, static or quantized layer) is refused: its states do not
  mean what this code assumes.
- **Slots written in place**: ``DynamicLayer.update`` concatenates, so every forward copies
  the whole cache of every layer (at batch 8 a tenth of a forward's time here, and device
  memory traffic on a GPU). A batch's cache is held in SlotLayers instead, a
  ``DynamicLayer`` whose states live in buffers with spare slots: new slots are written in
  place and ``keys``/``values`` are views of the slots held, which attention reads as the same
  values (the greedy texts are unchanged). Both generations call ``update(keys, values, ...)``
  and read ``keys`` to find the length, which is all a layer is asked for here. The buffers
  keep spare rows too: a request admitted in a finished one's place, a row dropped, a longer
  prompt's left widening and a compaction move only the slots they must, in place, where
  ``torch.cat``/``index_select`` copied the whole cache and left no spare slots behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lm_eval_safe.errors import UserError

#: One layer's states ``(keys, values)``, or None for a layer that holds nothing (a layer
#: that shares another's states never fills its own).
LayerStates = tuple[torch.Tensor, torch.Tensor] | None

class UnsupportedModelError(UserError, NotImplementedError):
    """A model or cache this module cannot drive faithfully; the message says what to do."""


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
        if target.numel():
            self.targets.append(target)
            self.sources.append(source)

    def zero(self, target: torch.Tensor) -> None:
        if target.numel():
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
        cls, keys: torch.Tensor, values: torch.Tensor, spare: int, rows: int | None = None, moves: Moves | None = None
    ) -> SlotLayer:
        """A layer holding copies of ``keys``/``values`` with ``spare`` slots after them;
        ``rows``: that many rows, each a copy of the states' single row. ``moves``: the copies
        join those of the other layers (run by the caller), else they run at once."""
        if rows is not None:
            keys, values = keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)
        layer = cls()
        layer.device = keys.device
        layer.is_initialized = True
        own = moves is None
        moves = Moves() if moves is None else moves
        layer._buffers = [_with_spare(keys, spare, moves), _with_spare(values, spare, moves)]
        if own:
            moves.run()
        layer._extent = [(keys.shape[0], keys.shape[2]), (values.shape[0], values.shape[2])]
        layer._peak_rows = keys.shape[0]
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

    def keep_rows(self, kept: Sequence[int], moves: Moves) -> None:
        """Keep the listed rows (ascending), in that order: the rows after the first gap move
        up, the ones before it stay where they are. Once half the row capacity or less is kept
        (a run's last requests, with none left to admit), the buffers shrink to the rows kept,
        so finished rows' memory is given back as it was when rows were copied out."""
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
        moved = next((i for i, row in enumerate(kept) if row != i), len(kept))
        if moved < len(kept):
            index = torch.tensor(kept[moved:], dtype=torch.long, device=buffers[0].device)
            for buffer in buffers:
                part = buffer[:, :, :held].index_select(0, index)  # a copy: rows overlap
                moves.copy(buffer[moved : len(kept), :, :held], part)
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
        self, begin: int, runs: Sequence[Sequence[tuple[int, int, int]]], width: int, moves: Moves
    ) -> Moves:
        """Each row's slots from ``begin`` on become ``width`` slots: its runs ``(source slot,
        target slot counted from begin, length)`` copied out, zeros in the rest. The copies go to a scratch tensor
        first (``moves``, run by the caller) and come back by the returned moves, as a run may
        move right over slots another run still has to read."""
        buffers, rows, held = self._held()
        back = Moves()
        for buffer in buffers:
            scratch = buffer.new_empty((rows, buffer.shape[1], width, buffer.shape[3]))
            for row, row_runs in enumerate(runs):
                filled = 0
                for source, target, length in row_runs:
                    moves.zero(scratch[row, :, filled:target])
                    moves.copy(scratch[row, :, target : target + length], buffer[row, :, source : source + length])
                    filled = target + length
                moves.zero(scratch[row, :, filled:width])
            back.copy(buffer[:rows, :, begin : begin + width], scratch)
        self._extent = [(rows, begin + width)] * 2
        return back

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


def _with_spare(tensor: torch.Tensor, spare: int, moves: Moves) -> torch.Tensor:
    out = tensor.new_empty((*tensor.shape[:2], tensor.shape[2] + spare, tensor.shape[3]))
    moves.copy(out[:, :, : tensor.shape[2]], tensor)
    return out


# -- caches -----------------------------------------------------------------------------------
def new_cache(states: Sequence[LayerStates] | None = None) -> Any:
    """A ``DynamicCache`` without a config, optionally holding ``states`` (the tensors
    themselves: a caller passes tensors no one else writes to).

    Without a config every layer keeps its full states, so a sliding-window model can be
    cropped and extended anywhere; the masks built here apply the window. A layer adopts its
    tensors as ``DynamicLayer.lazy_initialization`` starts one (whose ``update`` would copy
    them into a new tensor: a prefix store's reused states, two copies per layer, per prompt)."""
    cache = DynamicCache()
    for layer_states in states or ():
        layer = DynamicLayer()
        if layer_states is not None:
            keys, values = layer_states
            layer.dtype, layer.device = keys.dtype, keys.device
            layer.keys, layer.values, layer.is_initialized = keys, values, True
        cache.layers.append(layer)
    return cache


def _layers(cache: Any) -> list[Any]:
    layers = cache.layers
    for layer in layers:
        if type(layer) not in (DynamicLayer, SlotLayer, RowsLayer):
            raise UnsupportedModelError(
                f"a cache layer of type {type(layer).__name__}: lm-eval-safe manages "
                "DynamicLayer states only; report the model and the transformers version"
            )
    return layers


def layer_states(cache: Any) -> list[LayerStates]:
    """Each layer's ``(keys, values)``, None where the layer holds nothing."""
    return [(layer.keys, layer.values) if layer.is_initialized else None for layer in _layers(cache)]


def seq_length(cache: Any) -> int:
    """Slots held (the first filled layer's; all filled layers hold the same number)."""
    for states in layer_states(cache):
        if states is not None:
            return int(states[0].shape[2])
    return 0


def crop(cache: Any, length: int) -> None:
    """Keep the first ``length`` slots of every row."""
    for layer in _layers(cache):
        if type(layer) is SlotLayer:
            layer.crop_to(length)
        elif layer.is_initialized and layer.keys.shape[2] > length:
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]


def with_slots(cache: Any, spare: int = 0, rows: int | None = None) -> Any:
    """``cache`` with every filled layer a :class:`SlotLayer` (its states copied once, with
    ``spare`` slots after them): the cache a batch keeps across forwards. ``rows``: that many
    rows, each a copy of the cache's single row (a batch's first prompt, which its other rows'
    holes then copy until their own prompts are written over them)."""
    layers = _layers(cache)
    moves = Moves()
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            layers[i] = SlotLayer.holding(layer.keys, layer.values, spare, rows, moves)
    moves.run()
    return cache


def _slot_layers(cache: Any) -> list[SlotLayer]:
    """The filled layers of a batch's cache, which :func:`with_slots` made SlotLayers."""
    layers = [layer for layer in _layers(cache) if layer.is_initialized]
    if not all(type(layer) is SlotLayer for layer in layers):
        raise TypeError("a batch's rows are added and dropped in a with_slots() cache only")
    return layers


@torch.inference_mode()  # the buffers are inference tensors: written in place
def add_rows(cache: Any, count: int) -> None:
    """``count`` rows of holes (zeros) after the cache's rows, in place while the buffers have
    room (a batch keeps the rows its size allows)."""
    moves = Moves()
    for layer in _slot_layers(cache):
        layer.add_rows(count, moves)
    moves.run()


@torch.inference_mode()  # the buffers are inference tensors: written in place
def keep_rows(cache: Any, rows: Sequence[int]) -> None:
    """Keep the listed rows (ascending) in that order, moving only the rows after a gap."""
    moves = Moves()
    for layer in _slot_layers(cache):
        layer.keep_rows(rows, moves)
    moves.run()


@torch.inference_mode()  # the buffers are inference tensors: written in place
def widen_left(cache: Any, grow: int) -> None:
    """``grow`` slots of holes (zeros) before every row's slots (a longer prompt arrived)."""
    moves = Moves()
    for layer in _slot_layers(cache):
        layer.widen_left(grow, moves)
    moves.run()


@torch.inference_mode()  # the buffers are inference tensors: written in place
def compact_slots(cache: Any, begin: int, live: Sequence[Sequence[int]], width: int) -> None:
    """Row ``r`` keeps, after slot ``begin``, its slots ``live[r]`` (ascending, ``begin`` or
    later), in order, right-aligned in ``width`` slots; the slots before them become holes
    (zeros) and the slots before ``begin`` stay as they are. A compaction of the generated
    tail, where a rollback's holes lie: the rows' prompts are never copied, and the runs of
    every row and layer move in two ``torch._foreach_copy_`` (out and back), where a gather over
    every slot walked the index element by element, layer by layer."""
    runs = [_runs(slots, width - len(slots)) for slots in live]
    out = Moves()
    backs = [layer.compact_slots(begin, runs, width, out) for layer in _slot_layers(cache)]
    out.run()
    for back in backs:
        out.targets += back.targets
        out.sources += back.sources
    out.run()


def _runs(slots: Sequence[int], target: int) -> list[tuple[int, int, int]]:
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


def select_rows(cache: Any, rows: torch.Tensor | list[int]) -> Any:
    """A new cache holding copies of the given rows (repeats allowed: one row per choice of a
    multiple-choice context). Each layer is indexed on its own device (``device_map`` spreads
    layers over several GPUs)."""
    index = torch.as_tensor(rows, dtype=torch.long)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, index.to(t.device))

    return new_cache([None if s is None else (pick(s[0]), pick(s[1])) for s in layer_states(cache)])


def rows_view(cache: Any, rows: list[int]) -> Any:
    """A cache of some rows (ascending) of a batch's :func:`with_slots` cache, for one forward
    of those rows alone: its new slots go into the batch's buffers (:class:`RowsLayer`)."""
    index = torch.tensor(rows, dtype=torch.long)
    out = DynamicCache()
    for layer in _layers(cache):
        if not layer.is_initialized:
            out.layers.append(DynamicLayer())
        elif type(layer) is SlotLayer:
            out.layers.append(RowsLayer(layer, index.to(layer.device)))
        else:
            raise TypeError("rows_view reads a with_slots() cache only")
    return out


def write_row(cache: Any, row: int, start: int, source: Any) -> None:
    """Copy the single row of ``source`` into ``row`` of ``cache`` from slot ``start`` on."""
    moves = Moves()
    for mine, theirs in zip(layer_states(cache), layer_states(source), strict=True):
        if (mine is None) != (theirs is None):
            raise UnsupportedModelError("two caches of one model disagree on which layers hold states")
        if mine is not None and theirs is not None:
            width = theirs[0].shape[2]
            moves.copy(mine[0][row, :, start : start + width], theirs[0][0])
            moves.copy(mine[1][row, :, start : start + width], theirs[1][0])
    moves.run()


def stack_left_padded(caches: Sequence[Any], width: int) -> Any:
    """One cache whose row ``b`` holds ``caches[b]``'s single row right-aligned in ``width``
    slots (zeros before it, masked by the caller's attention mask)."""
    stacked: list[LayerStates] = []
    for parts in zip(*(layer_states(c) for c in caches), strict=True):
        if any(p is None for p in parts):
            if not all(p is None for p in parts):
                raise UnsupportedModelError("caches of one model disagree on which layers hold states")
            stacked.append(None)
            continue
        pair = []
        for k in (0, 1):
            tensors = [p[k] for p in parts]  # type: ignore[index]
            first = tensors[0]
            out = first.new_zeros((len(tensors), first.shape[1], width, first.shape[3]))
            for b, t in enumerate(tensors):
                out[b, :, width - t.shape[2] :] = t[0]
            pair.append(out)
        stacked.append((pair[0], pair[1]))
    return new_cache(stacked)
