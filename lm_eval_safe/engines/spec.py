"""What an engine is to the rest of the package: an :class:`EngineSpec`, the ``ENGINE`` of its
package (:mod:`lm_eval_safe.engines.registry` names the packages).

The spec is the engine's one door: the option keys it claims and their checks, its checks of
the ensemble's options, its version check, its placement plan, loading one member, and how many
rows it decodes at once. What a loaded member's engine can do while decoding (full rows or
heads, stopping on text, prefix sharing) is its :class:`~lm_eval_safe.engines.base.MemberEngine`'s.
Importing a spec stays light (no torch, no engine library): options are checked with every
registered engine's spec before anything loads, on machines without the engine installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lm_eval_safe.members.sources import MemberSource

if TYPE_CHECKING:
    import torch

    from lm_eval_safe.members.member import Member


def head_width(top_logprobs: int, top_k: int) -> int:
    """Ids an engine's head holds: ``top_logprobs``, and at least one past ``top_k``. A head of
    exactly ``top_k`` ids cannot name the top-k strings: an id it does not know may tie its
    last one (:func:`lm_eval_safe.ensemble.certified._top_keys`), while one more id shows whether the
    k-th place is shared."""
    return max(top_logprobs, top_k + 1)


@dataclass(frozen=True)
class MemberLoad:
    """What every engine's loader is given for one member: its source, resolved and checked
    once before any member loads, and the ensemble's settings for it."""

    source: MemberSource
    index: int = 0
    dtype: str = "auto"
    trust_remote_code: bool = False
    cache_dir: str | None = None
    max_length: int | None = None  # max_length= (None: the checkpoint's own)
    add_bos_token: bool | None = None
    top_logprobs: int = 20  # ids of each position's head an engine reads back
    device: str | None = None  # the member's placement (None: auto)
    device_map: str | None = None


@dataclass
class LoadedMember:
    """What an engine's loader returns; :func:`lm_eval_safe.engines.load_source` makes the
    :class:`~lm_eval_safe.members.member.Member` of it (the tokenizer's pad id set, the context window
    read from the config where the engine leaves ``max_length`` None)."""

    tokenizer: Any
    config: Any  # transformers PretrainedConfig of the checkpoint
    generation_config: Any  # or None
    engine: Any  # MemberEngine
    device: str
    dtype: Any
    max_length: int | None = None


class Watch(Protocol):
    """The device a clock times, and a wait for its queued work (a GPU runs asynchronously)."""

    device: Any  # torch.device

    def settle(self) -> None: ...


class Clock(Protocol):
    """Seconds spent in some work while installed; :meth:`close` uninstalls it."""

    watch: Watch

    @property
    def seconds(self) -> float: ...

    def close(self) -> None: ...


class ForwardClock(Clock, Protocol):
    """Seconds inside the members' forwards, and each member's forward count."""

    forwards: Mapping[str, int]

    @property
    def depth(self) -> int:
        """How deep the current thread is inside a member's forward (0: outside)."""
        ...


#: ``(module, function names)`` pairs a :class:`Clock` times (the engine's own functions)
ClockTargets = Sequence[tuple[Any, Sequence[str]]]


class Instruments(Protocol):
    """What ``lm_eval_safe.bench`` measures or alters inside a member's model, as an engine
    offers it (:meth:`EngineSpec.instruments`; the transformers engine's module). The
    benchmarks reach a model through these names only, so an engine offering instruments
    offers all of them (:func:`lm_eval_safe.engines.instruments` checks it)."""

    #: the engine's KV-cache moves and head cutting, as targets of :attr:`FunctionClock`
    CACHE_MOVES: ClockTargets
    HEADS_WORK: ClockTargets
    #: ``ForwardClock(members)``: times the members' forwards while installed
    ForwardClock: Callable[[Sequence[Member]], ForwardClock]
    #: ``FunctionClock(targets, device)``: times the named functions while installed
    FunctionClock: Callable[[ClockTargets, Any], Clock]

    def mask_eos(self, member: Member) -> None: ...

    def favour_ids(self, member: Member, ids: list[int], bonus: float) -> None: ...

    def prompt_logits(self, member: Member, ids: list[int]) -> torch.Tensor: ...

    def generate(
        self, member: Member, prompts: Sequence[list[int]], max_new_tokens: int, pad: int, own_eos: bool = True
    ) -> list[list[int]]: ...

    def forward_seconds(self, member: Member, prompt_ids: list[int], repeats: int = 7) -> tuple[float, float]: ...

    def model_tensors(self, member: Member) -> Iterator[torch.Tensor]: ...

    def parameter_count(self, member: Member) -> int: ...

    def as_member(self, model: Any, tokenizer: Any, name: str, index: int = 0) -> Member: ...


def missing_instruments(tools: object) -> list[str]:
    """The names of :class:`Instruments` that ``tools`` lacks (a module is checked by its
    names: a protocol cannot check a module at run time on every supported Python)."""
    names = set(Instruments.__annotations__) | {
        name for name, value in vars(Instruments).items() if callable(value) and not name.startswith("_")
    }
    return sorted(name for name in names if not hasattr(tools, name))


class EngineSpec:
    """One engine's door. Subclass it in ``engines/<name>/__init__.py`` as ``ENGINE``; only
    :meth:`load` and :meth:`generation_rows` must be written, the rest have neutral defaults."""

    #: what ``engine=``/``engines=`` call it: its key in the registry, and its engines' ``kind``
    name: str = ""
    #: the ``--model_args`` keys this engine claims, with their defaults (every registered
    #: engine's are options of every run, read as ``options.<key>``)
    options: Mapping[str, Any] = {}
    #: whether ``--model_args`` keys no one claims are this engine's arguments (they go to
    #: ``options.engine_args`` when a member runs on it, and are refused otherwise)
    passthrough: bool = False

    def parse_option(self, key: str, value: Any) -> Any:
        """A claimed key's value as typed, parsed and checked (one-line :class:`OptionError`)."""
        return value

    def take_arguments(self, raw: dict[str, Any], unknown: Sequence[str]) -> dict[str, Any]:
        """The passed-through arguments of a :attr:`passthrough` engine out of ``raw`` (its
        aliases of ensemble options may be written back into ``raw``)."""
        return {key: raw[key] for key in unknown}

    def check_options(self, options: Any) -> None:
        """Checks of the ensemble's options for members on this engine (one-line OptionError)."""

    def check_versions(self) -> None:
        """Refuse an untested version of the engine's library (one line; before any loading)."""

    def check_source(self, source: MemberSource) -> None:
        """Refuse a member this engine cannot load (one line), checked for every member before
        the first one loads: loading takes minutes, and a refusal after it wastes them."""

    def plan(
        self, options: Any, placements: Sequence[Any], indices: Sequence[int], rank: int, world_size: int
    ) -> list[dict[str, Any]]:
        """This engine's own loading settings for the members at ``indices`` (keyword arguments
        of :meth:`load`), decided and checked for all of them before the first one loads."""
        return [self.member_settings(options) for _ in indices]

    def member_settings(self, options: Any) -> dict[str, Any]:
        """:meth:`plan`'s settings of one member: by default the claimed options' values."""
        return {key: getattr(options, key) for key in self.options}

    def load(self, load: MemberLoad, **settings: Any) -> LoadedMember:
        """Load one member (``settings``: this engine's, from :meth:`plan`)."""
        raise NotImplementedError

    def generation_rows(self, members: Sequence[Any], jobs: Sequence[Any]) -> int:
        """``batch_size=auto`` for lm-eval: rows this engine's ``members`` decode together."""
        raise NotImplementedError

    def serving_rows(self, members: Sequence[Any]) -> int | None:
        """Most rows the server may decode together on this engine's ``members`` (None: no
        bound of the engine's own)."""
        return None

    def instruments(self) -> Instruments | None:
        """This engine's benchmark instruments (:class:`Instruments`: hooks on a member's model,
        EOS masking, forward clocks, one forward's latency, ``generate``), or None where the
        engine's models cannot be reached from this process (the benchmarks that need them
        refuse its members). Imported only when asked for: it may import torch."""
        return None

    def thread_device(self, member: Any) -> Any:
        """The torch device a member's forwards run on when the decoder may run them on a
        thread of their own (``overlap=``), or None where the engine overlaps its own work."""
        return None
