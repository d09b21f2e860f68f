"""The clocks of the host-work benchmark (:mod:`lm_eval_safe.bench.host_work`, reached through
:mod:`.instruments`): the members' forwards, and named
functions between them (KV-cache moves, heads), each timed on the host or, on a GPU, with CUDA
events on the members' stream (an asynchronous call's host time is only its launches)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from lm_eval_safe.engines.hf import heads, kv_cache, model_calls, packed_slots
from lm_eval_safe.members.member import Member


class _Depth(threading.local):
    """A thread's nesting of member forwards (verifiers may run on threads of their own)."""

    depth = 0
    start: Any = 0.0


class Stopwatch:
    """Summed intervals of the members' device's time. A CPU runs the work in line, so the host
    clock is its time; a GPU runs it asynchronously (the host's time inside a call is only its
    launches), so each interval is a pair of CUDA events on the device's stream: from when the
    device reaches the first (after the work queued before it) to when it has run the call's
    last kernel. Either way, wall time less these intervals is the device's time outside them.
    Event pairs are read at :attr:`seconds`, which waits for the device once."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self._seconds = 0.0
        self._pairs: list[tuple[Any, Any]] = []

    def mark(self) -> Any:
        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, start: Any) -> None:
        """The interval from ``start`` (a :meth:`mark`) to now."""
        if not self.on_gpu:
            self._seconds += time.perf_counter() - start
            return
        self._pairs.append((start, self.mark()))  # list.append: safe from verifier threads

    def settle(self) -> None:
        """Wait for the device's queued work (the end of a timed run on a GPU)."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    @property
    def seconds(self) -> float:
        if self._pairs:
            self.settle()
            pairs, self._pairs = self._pairs, []
            self._seconds += sum(start.elapsed_time(end) for start, end in pairs) / 1e3
        return self._seconds


def members_device(members: Sequence[Member]) -> torch.device:
    """The one device every member computes on; the clocks time one device's stream."""
    devices = {str(member.engine.input_device) for member in members}
    if len(devices) != 1:
        raise ValueError(f"members on {sorted(devices)}: time host work with every member on one device")
    return torch.device(devices.pop())


class ForwardClock:
    """Seconds spent inside the members' forwards (outermost module call counted once): the
    model, its decoder body, its output layer, and the batch's output logits
    (``model_calls.output_logits``: the output layer and Gemma's soft-capping after it, which
    the whole model's forward computes inside itself)."""

    def __init__(self, members: Sequence[Member]):
        self.watch = Stopwatch(members_device(members))
        self.forwards: Counter[str] = Counter()  # per member: its batch steps and prefills
        self._local = _Depth()
        self._handles: list[Any] = []
        for member in members:
            model = member.engine.model
            leave = partial(self._leave, member.name)
            for module in {model, model_calls.decoder(model), model.get_output_embeddings()}:
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(leave))
        self._output_logits = model_calls.output_logits
        model_calls.output_logits = self._timed_output_logits

    def _timed_output_logits(self, model: Any, hidden: torch.Tensor) -> torch.Tensor:
        self._enter(model, None)
        try:
            return self._output_logits(model, hidden)
        finally:
            self._local.depth = self.depth - 1
            if self.depth == 0:
                self.watch.add(self._local.start)

    @property
    def seconds(self) -> float:
        return self.watch.seconds

    @property
    def depth(self) -> int:
        return self._local.depth

    def _enter(self, _module: Any, _args: Any) -> None:
        if self.depth == 0:
            self._local.start = self.watch.mark()
        self._local.depth = self.depth + 1

    def _leave(self, name: str, _module: Any, _args: Any, _out: Any) -> None:
        self._local.depth = self.depth - 1
        if self.depth == 0:
            self.watch.add(self._local.start)
            self.forwards[name] += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        model_calls.output_logits = self._output_logits


#: The KV-cache operations the transformers batch runs between forwards: rows added, dropped,
#: spliced in, cropped, compacted, selected for scoring. Device work (on a GPU they run
#: asynchronously, with no host wait); timed apart so the Python share of the host time shows.
CACHE_MOVES = (
    (kv_cache, ("with_slots", "add_rows", "keep_rows", "widen_left", "compact_slots", "select_rows", "write_row", "crop", "new_cache")),
    (packed_slots, ("concat_slots", "pack_row_slots")),
    (packed_slots.RowPacker, ("__init__", "pack", "pack_blocks")),
)

#: The heads cut from the forwards' logits (log-softmax, argmax, top-k over a vocabulary), read
#: back and unpacked, and the wider heads and full rows asked for later: device work mostly,
#: timed apart likewise (the read-back and the unpacking, host work, go with it: a few
#: microseconds a position).
HEADS_WORK = ((heads, ("read_heads", "cut_heads", "read_cuts", "wider_heads", "full_rows")),)


class FunctionClock:
    """Seconds inside the named functions of some modules (outermost call once), while
    installed (callers reach them through their module: ``kv_cache.crop``,
    ``heads.cut_heads``)."""

    def __init__(self, targets: Sequence[tuple[Any, Sequence[str]]], device: torch.device) -> None:
        self.watch = Stopwatch(device)
        self._local = _Depth()
        self._saved = [(module, name, getattr(module, name)) for module, names in targets for name in names]
        for module, name, function in self._saved:
            setattr(module, name, self._timed(function))

    def _timed(self, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            local = self._local
            if local.depth:
                return function(*args, **kwargs)
            local.depth, start = 1, self.watch.mark()
            try:
                return function(*args, **kwargs)
            finally:
                local.depth = 0
                self.watch.add(start)

        return timed

    @property
    def seconds(self) -> float:
        return self.watch.seconds

    def close(self) -> None:
        for module, name, function in self._saved:
            setattr(module, name, function)
