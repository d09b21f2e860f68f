"""Engines: what computes a member's forwards, reached through one door per engine.

- :mod:`.registry` names the engines (``engine=``/``engines=`` take its names) and their
  packages; it imports nothing.
- each package's ``ENGINE`` (an :class:`.spec.EngineSpec`) is the engine to the rest of the
  package: its options, checks, placement plan, loader and row sizing;
- a loaded member's engine is a :class:`.base.MemberEngine` (the batch seam the decoder drives).

Adding an engine: write ``engines/<name>/__init__.py`` with ``ENGINE = <EngineSpec subclass>()``
(``name``, :meth:`~.spec.EngineSpec.load` returning a :class:`~.spec.LoadedMember` whose engine
is a :class:`~.base.MemberEngine` with ``kind = name``, and
:meth:`~.spec.EngineSpec.generation_rows`; the rest as needed), then add its line to
:mod:`.registry` (or call :func:`.registry.register` from outside the package). The loops here,
option validation, overlap and the server's row sizing find it there; nothing else names it.

This module stays import-light: an engine's heavy modules are imported only when a member is
loaded on it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from importlib import import_module
from typing import Any

from lm_eval_safe.engines.registry import DEFAULT_ENGINE, engine_names, engine_package
from lm_eval_safe.engines.spec import (
    EngineSpec,
    Instruments,
    MemberLoad,
    head_width,
    missing_instruments,
)
from lm_eval_safe.members.sources import MemberSource

logger = logging.getLogger(__name__)


def engine(name: str) -> EngineSpec:
    """The spec of the engine registered as ``name``."""
    spec = import_module(engine_package(name)).ENGINE
    if spec.name != name:
        raise RuntimeError(f"engine {name!r}: {engine_package(name)}.ENGINE is named {spec.name!r}")
    return spec


def engines() -> list[EngineSpec]:
    """Every registered engine's spec, in the registry's order."""
    return [engine(name) for name in engine_names()]


def members_by_engine(members: Sequence[Any]) -> dict[str, list[Any]]:
    """The members on each engine, engines in the order their first member comes."""
    groups: dict[str, list[Any]] = {}
    for member in members:
        groups.setdefault(member.engine.kind, []).append(member)
    return groups


def load_source(load: MemberLoad, engine_name: str, **settings: Any) -> Any:
    """One member, its source resolved, on ``engine_name`` (``settings``: that engine's)."""
    from lm_eval_safe.members.member import member_of

    return member_of(engine(engine_name).load(load, **settings), load)


def check_sources(sources: Sequence[MemberSource], names: Sequence[str]) -> None:
    """What every load runs before its first member loads: each GGUF file's header, each
    engine's versions, and whether each engine can load its members (``names``: the engine of
    each source)."""
    from lm_eval_safe.members.sources import check_gguf_file

    for source in sources:
        if source.kind == "gguf":
            check_gguf_file(source)
    for name in dict.fromkeys(names):
        spec = engine(name)
        for source, of in zip(sources, names, strict=True):
            if of == name:
                spec.check_source(source)
        spec.check_versions()


def load_member(spec: str, *, engine: str = DEFAULT_ENGINE, **settings: Any) -> Any:
    """Load one member from its spec: ``settings`` are :class:`~.spec.MemberLoad`'s fields
    (``device``, ``dtype``, ``max_length``...) and the engine's own (its ``plan`` settings,
    e.g. ``fast_small_linear=``). Benchmarks and tests load members one by one this way, with
    the checks :func:`load_members` runs (:func:`check_sources`)."""
    from dataclasses import fields

    from lm_eval_safe.members.sources import resolve_source

    common = {f.name for f in fields(MemberLoad)}
    shared = {k: v for k, v in settings.items() if k in common}
    own = {k: v for k, v in settings.items() if k not in common}
    source = resolve_source(spec, shared.get("cache_dir"))
    check_sources([source], [engine])
    return load_source(MemberLoad(source, **shared), engine, **own)


def load_members(opts: Any, placements: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """Every member of ``opts`` on its engine and placement. Every source is resolved and
    checked (:func:`check_sources`), and each engine used plans its members, before the first
    member loads (that takes minutes)."""
    from lm_eval_safe.members.sources import resolve_source

    sources = [resolve_source(spec, opts.cache_dir) for spec in opts.members]
    names = opts.member_engines()
    check_sources(sources, names)
    settings: list[dict[str, Any]] = [{} for _ in names]
    for name in dict.fromkeys(names):
        spec = engine(name)
        indices = [i for i, n in enumerate(names) if n == name]
        for i, planned in zip(indices, spec.plan(opts, placements, indices, rank, world_size), strict=True):
            settings[i] = planned
    width = head_width(opts.top_logprobs, opts.top_k)
    members = []
    for i, source in enumerate(sources):
        load = MemberLoad(
            source,
            index=i,
            dtype=opts.dtype,
            trust_remote_code=opts.trust_remote_code,
            cache_dir=opts.cache_dir,
            max_length=opts.max_length,
            add_bos_token=opts.add_bos_token,
            top_logprobs=width,
            device=placements[i].device,
            device_map=placements[i].device_map,
        )
        members.append(load_source(load, names[i], **settings[i]))
    return members


def instruments(member: Any) -> Instruments:
    """The benchmark instruments of ``member``'s engine (:meth:`~.spec.EngineSpec.instruments`);
    a one-line error where its engine has none, or lacks some of the protocol's names, so a
    benchmark never reaches into a model nor fails halfway through a run."""
    kind = member.engine.kind
    tools = engine(kind).instruments()
    if tools is None:
        raise RuntimeError(f"{member.name}: the {kind} engine has no benchmark instruments")
    missing = missing_instruments(tools)
    if missing:
        raise RuntimeError(f"the {kind} engine's benchmark instruments lack {', '.join(missing)}")
    return tools


@contextmanager
def engines_active(members: Iterable[Any]) -> Iterator[None]:
    """Every member's engine settings active for the calls run inside this block (the
    transformers engine's small-row linears)."""
    with ExitStack() as stack:
        for member in members:
            stack.enter_context(member.engine.active())
        yield


def generation_rows(options: Any, members: Sequence[Any], jobs: Sequence[Any]) -> int:
    """Rows decoded together: ``batch_size`` as given; for ``auto`` the fewest that any
    engine's members hold (each engine sizes its own: GPU memory for transformers, the engine's
    ``max_num_seqs`` for vLLM), at most ``max_batch_size``."""
    if options.batch_size != "auto":
        return max(1, int(options.batch_size))
    if not jobs:
        return 1
    rows = [engine(name).generation_rows(group, jobs) for name, group in members_by_engine(members).items()]
    return int(max(1, min(*rows, options.max_batch_size)))


def serving_rows(options: Any, members: Sequence[Any], asked: int | None = None) -> int:
    """Rows the server decodes together: ``asked`` (``batch_size`` as a number) or else
    ``max_batch_size``, at most what each engine's members hold at once beside the scoring a
    request may ask for between two cycles (:meth:`~.spec.EngineSpec.serving_rows`). A number
    lowered so says so in one log line."""
    bounds = {name: engine(name).serving_rows(group) for name, group in members_by_engine(members).items()}
    rows = min([asked or options.max_batch_size, *(b for b in bounds.values() if b is not None)])
    if asked is not None and rows < asked:
        held = ", ".join(f"{name} {bound}" for name, bound in bounds.items() if bound is not None)
        logger.warning("batch_size=%d: the server decodes %d rows at once (rows each engine serves: %s)", asked, rows, held)
    return int(rows)
