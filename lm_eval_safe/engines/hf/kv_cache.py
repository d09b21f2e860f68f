"""transformers' KV caches, one of the four modules that know transformers' internals (with
:mod:`.model_calls`: the forward's cache keyword, masks, the output head; :mod:`.packed_slots`:
a prefix store's blocks; and :mod:`.slot_layers`: a batch's layers, their buffers and moves).

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

from lm_eval_safe.engines.hf.slot_layers import Moves, RowsLayer, SlotLayer, runs
from lm_eval_safe.errors import UserError

#: One layer's states ``(keys, values)``, or None for a layer that holds nothing (a layer
#: that shares another's states never fills its own).
LayerStates = tuple[torch.Tensor, torch.Tensor] | None

class UnsupportedModelError(UserError, NotImplementedError):
    """A model or cache this module cannot drive faithfully; the message says what to do."""


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


def with_slots(cache: Any, spare: int = 0, rows: int | None = None, row: int | None = None) -> Any:
    """``cache`` with every filled layer a :class:`SlotLayer` (its states copied once, with
    ``spare`` slots after them): the cache a batch keeps across forwards. ``rows``: that many
    rows, each a copy of the cache's single row; with ``row``, that row alone holds it (a
    batch's first prompt) and the others are holes (zeros) until their own prompts are
    written over them."""
    layers = _layers(cache)
    moves = Moves()
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            layers[i] = SlotLayer.holding(layer.keys, layer.values, spare, rows, moves, row)
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
    """Row ``i`` becomes the listed ``rows[i]``, moving only the rows not already in place."""
    moves, back = Moves(), Moves()
    for layer in _slot_layers(cache):
        layer.keep_rows(rows, moves, back)
    moves.run()
    back.run()


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
    row_runs = [runs(slots, width - len(slots)) for slots in live]
    moves, back = Moves(), Moves()
    for layer in _slot_layers(cache):
        layer.compact_slots(begin, row_runs, width, moves, back)
    moves.run()
    back.run()


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
    on_device: dict[Any, torch.Tensor] = {}  # the index once per device (device_map spreads layers)
    out = DynamicCache()
    for layer in _layers(cache):
        if not layer.is_initialized:
            out.layers.append(DynamicLayer())
        elif type(layer) is SlotLayer:
            if layer.device not in on_device:
                on_device[layer.device] = torch.tensor(rows, dtype=torch.long, device=layer.device)
            out.layers.append(RowsLayer(layer, on_device[layer.device]))
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
