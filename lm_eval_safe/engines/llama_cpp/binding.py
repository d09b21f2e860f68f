"""What this engine needs of llama-cpp-python's ctypes bindings: the releases it is tested on,
and the structure fields its exactness rests on, checked instead of assumed.

ctypes takes an assignment to a field a structure lacks as a plain Python attribute, without a
word. A binding whose ``llama_context_params`` had no ``kv_unified`` would run one unified KV
cache, and one without ``use_extra_bufts`` the repacked weight layouts: both make a row's
logits depend on its batch (:mod:`.slots`), and nothing would say so. So every field this
engine sets is checked to be one of its structure's, before any member loads
(:func:`check_binding`) and again where it is set (:func:`set_fields`).
"""

from __future__ import annotations

from typing import Any

from lm_eval_safe.errors import OptionError
from lm_eval_safe.versions import refuse

INSTALL_HINT = (
    "engine=llama_cpp needs llama-cpp-python: pip install 'lm-eval-safe[llama-cpp]' "
    "(built from source: needs cmake and a C++ compiler), or bash scripts/setup.sh --llama-cpp"
)


def require_llama_cpp() -> None:
    """Refuse in one line where llama-cpp-python is not installed (before its import fails)."""
    from importlib.util import find_spec

    if find_spec("llama_cpp") is None:
        raise OptionError(INSTALL_HINT)


#: llama-cpp-python releases this engine is tested on (the ``llama-cpp`` extra's range)
TESTED = ("0.3.36", "0.4")
#: every field this engine sets, by structure: ``use_extra_bufts`` (repacked layouts off),
#: ``kv_unified`` (a KV stream per sequence) and ``swa_full`` (rollback on sliding-window
#: layers) are the ones the rows' exactness rests on
FIELDS: dict[str, tuple[str, ...]] = {
    "llama_model_params": ("n_gpu_layers", "use_extra_bufts"),
    "llama_context_params": (
        "n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch",
        "flash_attn_type", "kv_unified", "swa_full", "no_perf",
    ),
}


def tested_range() -> str:
    low, high = TESTED
    return f">={low},<{high}"


def _fields(structure: type) -> set[str]:
    return {entry[0] for entry in structure._fields_}


def missing_fields(lib: Any) -> list[str]:
    """``structure.field`` of every field :data:`FIELDS` names that ``lib``'s structures lack."""
    return [
        f"{structure}.{name}"
        for structure, names in FIELDS.items()
        for name in names
        if name not in _fields(getattr(lib, structure))
    ]


def _refuse_missing(missing: list[str], version: str) -> None:
    raise OptionError(
        f"llama-cpp-python {version} lacks {', '.join(missing)}, which engine=llama_cpp sets so "
        f"that a row's text does not depend on its batch (tested: {tested_range()}): "
        f"pip install 'llama-cpp-python{tested_range()}'"
    )


def check_binding() -> None:
    """Refuse an untested llama-cpp-python (as the vLLM engine refuses an untested vLLM:
    ``LM_EVAL_SAFE_ALLOW_UNTESTED_VERSIONS=1`` goes on), and always one whose structures lack a
    field :data:`FIELDS` names (no setting makes such a binding exact)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    require_llama_cpp()
    try:
        found = version("llama-cpp-python")
    except PackageNotFoundError:
        raise OptionError(INSTALL_HINT) from None
    low, high = (Version(v) for v in TESTED)
    if not low <= Version(found) < high:
        refuse([
            f"llama-cpp-python {found} is untested for engine=llama_cpp (tested: {tested_range()}): "
            f"pip install 'llama-cpp-python{tested_range()}'"
        ])
    import llama_cpp

    missing = missing_fields(llama_cpp)
    if missing:
        _refuse_missing(missing, found)


def set_fields(structure: Any, **values: Any) -> None:
    """Set fields of a ctypes structure, each checked to be one of its fields first."""
    missing = [f"{type(structure).__name__}.{name}" for name in values if name not in _fields(type(structure))]
    if missing:
        from importlib.metadata import version

        _refuse_missing(missing, version("llama-cpp-python"))
    for name, value in values.items():
        setattr(structure, name, value)
