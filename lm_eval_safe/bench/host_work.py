"""Host work per generated token (``lm-eval-safe bench host``): the time a GPU would leave idle.

On a GPU the members' forwards shrink by one or two orders of magnitude and the Python work
between them does not, so the figure that decides whether a device stays busy is *wall time
minus the time inside the members' forwards*, per generated token. Two instruments measure it
on any machine:

- the forward clock (the member's engine's instrument; transformers: forward hooks on the model, its decoder body
  and its output layer): the outermost of them is timed, so a forward that runs the body and
  then the head (the batch's path) counts both once, and a whole-model forward counts once.
- :class:`SyncCounter`: the device-to-host synchronisations the host code asks for. Every
  tensor computed from a member's weights is *on the member's device* (tagged as it flows
  through torch functions); reading one back (``.item()``, ``.tolist()``, ``.cpu()``,
  ``.numpy()``, ``int()``/``float()``/``bool()``, an index, a Python branch) is a
  synchronisation on a GPU, even though on a CPU it is free. Synchronisations inside a forward
  (transformers' own) are counted apart. The counter slows torch calls down, so it runs in a
  pass of its own, after the timed one, on the same jobs (the texts must come out the same).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lm_eval_safe.bench.batch_packing import best_rows_apart, lock_step, packing_bound
from lm_eval_safe.decoder.latency import CycleForwards
from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.decoder.stats import total
from lm_eval_safe.engines import instruments
from lm_eval_safe.members.member import Member

#: configuration -> SafeDecoder options (the drafter alone and SAFE with each aggregator)
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "drafter": {"schedule": "drafter"},
    "unite_safe": {"schedule": "safe", "aggregator": "unite"},
    "gac_safe": {"schedule": "safe", "aggregator": "gac"},
}

_TAG = "_lm_eval_safe_device_member"

#: torch functions that hand a tensor's value to Python (a device-to-host synchronisation on a
#: GPU); ``Tensor.to`` counts only when it moves to the CPU
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class SyncCounter(TorchFunctionMode):
    """Device-to-host reads of tensors computed from the members' weights, per member, outside
    the forwards (``host``) and inside them (``in_forward``, transformers' own); and the
    kernels launched outside the forwards (``device_ops``): every torch call on such a tensor
    that computes or writes data (:func:`_runs_kernel`: not a view, a metadata query, an
    allocation or a no-op conversion), each a launch a GPU's host pays for. Every other torch
    call outside the forwards is host work on any machine (views, shapes; positions and masks
    built on the host before they move): counted apart (``host_ops``)."""

    def __init__(self, members: Sequence[Member], clock: Any):
        super().__init__()
        self.clock = clock
        self.host: Counter[str] = Counter()
        self.in_forward: Counter[str] = Counter()
        self.device_ops = 0
        self.host_ops = 0
        self.names = [m.name for m in members]
        for index, member in enumerate(members):
            for tensor in instruments(member).model_tensors(member):
                setattr(tensor, _TAG, index)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        member = _member_of((args, kwargs))
        # inside a forward, ``.to`` moves between the model's own devices (transformers' rotary
        # tables go ``.to(x.device)``, a GPU on a GPU): only this project's code names the host
        moves_to_host = func is torch.Tensor.to and not self.clock.depth and _to_cpu(args, kwargs)
        read = member is not None and (func in _READS or moves_to_host)
        if read:
            (self.in_forward if self.clock.depth else self.host)[self.names[member]] += 1
        out = func(*args, **kwargs)  # the mode is off inside func: its own torch calls unseen
        if not (self.clock.depth or read):
            if member is not None and _runs_kernel(func, args, kwargs, out):
                self.device_ops += 1
            else:
                self.host_ops += 1
        if member is not None and not read:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    setattr(tensor, _TAG, member)
        elif read and isinstance(out, torch.Tensor) and out is args[0]:
            out = out.view_as(out)  # the host copy a GPU would return: no longer on the device
        return out


#: a torch method writing its first argument (``x.zero_()``, ``x += y``)
_IN_PLACE = re.compile(r"^[a-z][a-z0-9_]*_$|^__i(add|sub|mul|truediv|floordiv|mod|pow|and|or|xor|lshift|rshift|matmul)__$")
#: calls that allocate without computing (a caching allocator's work, on the host)
_ALLOCATIONS = {"new_empty", "empty", "empty_like"}


def _runs_kernel(func: Any, args: Any, kwargs: Any, out: Any) -> bool:
    """Whether a torch call computed or wrote tensor data (a kernel on a GPU) rather than
    reading metadata (a shape, ``numel``), making a view (a slice, ``expand``, ``unflatten``),
    allocating, or returning its input unchanged (``.to`` the dtype it has). A view is told by
    its storage, which is an input's (inference mode keeps no view records)."""
    if out is None:  # __setitem__, and the other writes that return nothing
        return True
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    name = getattr(func, "__name__", "")
    if not outputs or name in _ALLOCATIONS:
        return False
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    for tensor in outputs:
        if tensor.numel() == 0:
            continue
        if tensor.untyped_storage().data_ptr() not in storages:
            return True  # new data
        if _IN_PLACE.match(name):  # zero_, copy_, __iadd__
            return True
    return False


def _member_of(tree: Any) -> int | None:
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            member = leaf.__dict__.get(_TAG)
            if member is not None:
                return member
    return None


def _to_cpu(args: Any, kwargs: Any) -> bool:
    targets = [*args[1:], kwargs.get("device")]
    return any(
        (isinstance(t, str) and t.startswith("cpu")) or (isinstance(t, torch.device) and t.type == "cpu")
        for t in targets
    )


@dataclass
class HostWork:
    """One configuration at one batch size."""

    configuration: str
    batch_size: int
    tokens: int = 0
    wall_seconds: float = 0.0
    forward_seconds: float = 0.0
    cache_move_seconds: float = 0.0
    forwards: dict[str, int] = field(default_factory=dict)
    engine_calls: dict[str, int] = field(default_factory=dict)
    cycles: int = 0
    ensemble_ops: int = 0
    host_syncs: dict[str, int] = field(default_factory=dict)
    forward_syncs: dict[str, int] = field(default_factory=dict)
    heads_seconds: float = 0.0  # cutting heads (and wider heads, full rows) from the logits
    device_ops: int | None = None  # kernels launched outside the forwards (the counted pass)
    host_ops: int | None = None
    texts: list[str] = field(default_factory=list)
    host_ms_per_token_repeats: list[float] = field(default_factory=list)  # every timed repeat
    #: each request's cycles, in the order the requests started (:mod:`.batch_packing` replays them)
    request_cycles: list[list[CycleForwards]] = field(default_factory=list)

    @property
    def host_ms_per_token(self) -> float:
        return 1e3 * (self.wall_seconds - self.forward_seconds) / max(1, self.tokens)

    @property
    def python_ms_per_token(self) -> float:
        """Host time less the KV-cache moves: what stays on the host on a GPU."""
        return 1e3 * (self.wall_seconds - self.forward_seconds - self.cache_move_seconds) / max(1, self.tokens)

    @property
    def device_seconds(self) -> float:
        """Device work between the forwards, timed in the same pass: KV moves and heads."""
        return self.cache_move_seconds + self.heads_seconds

    @property
    def host_less_device_ms_per_token(self) -> float:
        """Host time less the device work between the forwards: the Python, the host tensors and
        the reads a GPU's host still pays, per token (plus a launch per device op)."""
        return 1e3 * (self.wall_seconds - self.forward_seconds - self.device_seconds) / max(1, self.tokens)

    def summary(self) -> dict[str, Any]:
        tokens = max(1, self.tokens)
        return {
            "configuration": self.configuration,
            "batch_size": self.batch_size,
            "tokens": self.tokens,
            "wall_s": round(self.wall_seconds, 3),
            "forward_s": round(self.forward_seconds, 3),
            "cache_move_s": round(self.cache_move_seconds, 3),
            "host_ms_per_token": round(self.host_ms_per_token, 3),
            "host_ms_per_token_less_cache_moves": round(self.python_ms_per_token, 3),
            "forwards": self.forwards,
            "engine_calls": self.engine_calls,
            "cycles": self.cycles,
            "ensemble_ops": self.ensemble_ops,
            "host_syncs": self.host_syncs,
            "host_syncs_per_token": round(sum(self.host_syncs.values()) / tokens, 3),
            "host_syncs_per_forward": {
                name: round(self.host_syncs.get(name, 0) / max(1, n), 3)
                for name, n in self.forwards.items()
            },
            "host_syncs_per_engine_call": {
                name: round(self.host_syncs.get(name, 0) / max(1, n), 3)
                for name, n in self.engine_calls.items()
            },
            "forward_syncs_per_token": round(sum(self.forward_syncs.values()) / tokens, 3),
            "host_ms_per_token_repeats": self.host_ms_per_token_repeats,
        } | self._device_summary() | self._packing_summary()

    def _packing_summary(self) -> dict[str, Any]:
        """Forwards per token had the same cycles been batched otherwise (:mod:`.batch_packing`):
        as the driver runs them (which must give the forwards counted), with rows apart at the
        best ``verify_at``, and the bound no schedule beats."""
        if not self.request_cycles:
            return {}
        tokens, cycles, size = max(1, self.tokens), self.request_cycles, self.batch_size
        verify_at, apart = best_rows_apart(cycles, size)
        return {
            "packing": {
                "lock_step_forwards_per_token": round(lock_step(cycles, size).total / tokens, 4),
                "rows_apart_forwards_per_token": round(apart.total / tokens, 4),
                "rows_apart_verify_at": verify_at,
                "bound_forwards_per_token": round(packing_bound(cycles, size).total / tokens, 4),
                "drafts_per_token": round(sum(c.drafter for r in cycles for c in r) / tokens, 4),
            }
        }

    def _device_summary(self) -> dict[str, float | None]:
        tokens, forwards = max(1, self.tokens), sum(self.forwards.values())
        device_ops, host_ops = self.device_ops, self.host_ops  # None before the counted pass
        return {
            # device ops per token = forwards per token x device ops per forward: how many
            # forwards a token costs (a second member's, drafts thrown away, rows left out of a
            # batched forward) apart from the work cut from each
            "forwards_per_token": round(forwards / tokens, 4),
            "device_ops_per_forward": None if device_ops is None or not forwards else round(device_ops / forwards, 2),
            "heads_s": round(self.heads_seconds, 3),
            "device_ms_per_token": round(1e3 * self.device_seconds / tokens, 3),
            "host_ms_per_token_less_device_work": round(self.host_less_device_ms_per_token, 3),
            "device_ops_per_token": None if device_ops is None else round(device_ops / tokens, 2),
            "host_torch_ops_per_token": None if host_ops is None else round(host_ops / tokens, 2),
        }


@contextmanager
def _engine_calls(members: Sequence[Member], into: dict[str, int]) -> Iterator[None]:
    before = {m.name: m.engine.counters.calls for m in members}
    yield
    into.update({m.name: m.engine.counters.calls - before[m.name] for m in members})


def measure(
    configuration: str,
    decoder: SafeDecoder,
    jobs: list[GenerationJob],
    batch_size: int,
    count_syncs: bool = True,
) -> HostWork:
    """A timed pass (forward and KV-move clocks only), then, with ``count_syncs``, the
    counted pass (:func:`count_reads`)."""
    members = [decoder.drafter, *decoder.verifiers]
    work = HostWork(configuration, batch_size)
    for member in members:
        member.engine.forget_prefixes()
    tools = instruments(members[0])
    clock = tools.ForwardClock(members)
    moves = tools.FunctionClock(tools.CACHE_MOVES, clock.watch.device)
    cutting = tools.FunctionClock(tools.HEADS_WORK, clock.watch.device)
    try:
        with _engine_calls(members, work.engine_calls):
            clock.watch.settle()
            decoder.cycle_log = []
            start = time.perf_counter()
            results = decoder.generate_many(jobs, batch_size)
            clock.watch.settle()
            work.wall_seconds = time.perf_counter() - start
        work.request_cycles, decoder.cycle_log = decoder.cycle_log, None
        work.forward_seconds, work.forwards = clock.seconds, dict(clock.forwards)
        work.cache_move_seconds, work.heads_seconds = moves.seconds, cutting.seconds
    finally:
        cutting.close()
        moves.close()
        clock.close()
    work.texts = [text for text, _ in results]
    done = total(stats for _, stats in results)
    work.tokens, work.cycles, work.ensemble_ops = done.generated_tokens, done.cycles, done.ensemble_ops
    if count_syncs:
        count_reads(work, decoder, jobs)
    return work


def median_run(repeats: Sequence[HostWork]) -> HostWork:
    """The repeat with the median host time (the lower middle of an even count), noting every
    repeat's host ms/token; the repeats must have written the same texts."""
    if any(work.texts != repeats[0].texts for work in repeats):
        raise RuntimeError(f"{repeats[0].configuration}: repeated runs wrote other texts")
    ordered = sorted(repeats, key=lambda work: work.host_ms_per_token)
    median = ordered[(len(ordered) - 1) // 2]
    median.host_ms_per_token_repeats = [round(work.host_ms_per_token, 3) for work in repeats]
    return median


def count_reads(work: HostWork, decoder: SafeDecoder, jobs: list[GenerationJob]) -> None:
    """The same run again under the :class:`SyncCounter` (slow: never timed), which must write
    the timed pass's texts; fills ``work``'s sync counts. Benchmarks run every timed pass
    before the first counted one, so the counter's garbage never weighs on a timing."""
    members = [decoder.drafter, *decoder.verifiers]
    for member in members:
        member.engine.forget_prefixes()
    clock = instruments(members[0]).ForwardClock(members)
    try:
        counter = SyncCounter(members, clock)
        with counter:
            counted = decoder.generate_many(jobs, work.batch_size)
    finally:
        clock.close()
    if [text for text, _ in counted] != work.texts:
        raise RuntimeError(f"{work.configuration}: the counted pass wrote other texts than the timed one")
    work.host_syncs, work.forward_syncs = dict(counter.host), dict(counter.in_forward)
    work.device_ops, work.host_ops = counter.device_ops, counter.host_ops
