"""Which engines exist: one line per engine, its name (what ``engine=``/``engines=`` take) and
the package that implements it.

This module imports nothing when it is imported, so any layer may ask which engines exist without
loading one (:func:`register` imports the package it is given, to check its option keys). An
engine's package exposes ``ENGINE``, an :class:`~lm_eval_safe.engines.spec.EngineSpec`: the one
object through which the rest of the package reaches it (:func:`lm_eval_safe.engines.engine`).
Nothing outside ``engines/<name>/`` and this table names an engine (``tests/test_layout.py``).

A third engine is one folder and one line: ``lm_eval_safe/engines/<name>/__init__.py`` defining
``ENGINE = MySpec()`` and ``"<name>": "lm_eval_safe.engines.<name>"`` below; an engine kept
outside this package (a plug-in, a test) is added at run time with :func:`register`.
"""

from __future__ import annotations

from importlib import import_module

#: The engine of every member unless ``engine=``/``engines=`` say otherwise.
DEFAULT_ENGINE = "hf"

_PACKAGES: dict[str, str] = {
    "hf": "lm_eval_safe.engines.hf",  # transformers, stepped by this package's own batches
    "vllm": "lm_eval_safe.engines.vllm",  # one vLLM engine per member
    "llama_cpp": "lm_eval_safe.engines.llama_cpp",  # GGUF members on llama.cpp
}


def register(name: str, package: str) -> None:
    """Make ``name`` an engine, implemented by the importable module ``package`` (a dotted
    path) whose ``ENGINE`` is an :class:`~lm_eval_safe.engines.spec.EngineSpec` named ``name``.

    Every engine's option keys are options of every run (``options.<key>``), so a key two
    engines claim would be read as one engine's and silently given to the other: refused here,
    naming both."""
    if not name or name != name.strip().lower():
        raise ValueError(f"engine name {name!r}: lower case, no spaces")
    claimed = set(import_module(package).ENGINE.options)
    for other, other_package in _PACKAGES.items():
        shared = claimed & set(import_module(other_package).ENGINE.options) if other != name else set()
        if shared:
            raise ValueError(
                f"engine {name!r} claims {', '.join(sorted(shared))}, already an option of engine "
                f"{other!r}: give {name!r}'s option(s) names of their own"
            )
    _PACKAGES[name] = package


def unregister(name: str) -> None:
    """Forget an engine added with :func:`register` (tests restore the table this way)."""
    _PACKAGES.pop(name, None)


def engine_names() -> tuple[str, ...]:
    """Every engine's name, in the order registered."""
    return tuple(_PACKAGES)


def engine_package(name: str) -> str:
    """The dotted path of ``name``'s package (KeyError for no engine of that name)."""
    return _PACKAGES[name]
