"""What the stores share: a file's sha256, hashed once and checked against the digest a store
names it by, and the choice of a GGUF file among a repository's by llama.cpp's rule."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from lm_eval_safe.disk_cache import atomic_write_json, cache_root
from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.gguf_info import (
    is_model_file,
    matches_quant,
    quant_tag,
    split_index,
    split_parts,
)

logger = logging.getLogger(__name__)

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default


def sha256_of(parts: list[Path], out: BinaryIO | None = None) -> str:
    """The sha256 of the parts read in order (and written to ``out`` as they are read)."""
    digest = hashlib.sha256()
    for part in parts:
        with part.open("rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
                if out is not None:
                    out.write(block)
    return digest.hexdigest()


def _record(real: Path, configured_cache: str | None) -> Path:
    """Where a file's sha256 is kept, by its real path."""
    return cache_root(configured_cache) / "sha256" / f"{hashlib.sha1(str(real).encode()).hexdigest()}.json"


def _seen(real: Path) -> dict[str, Any]:
    """What a kept sha256 is reused for: the same file, size and time of change."""
    stat = real.stat()
    return {"path": str(real), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def file_sha256(path: Path, configured_cache: str | None = None) -> str:
    """The sha256 of a file's bytes, hashed once: the result is kept under the cache folder
    with the file's size and time of change, and reused while they stay the same (hashing runs
    at about 1 GB/s: seconds for a model of several GB, too long to repeat on every run)."""
    real = path.resolve()
    seen = _seen(real)
    record = _record(real, configured_cache)
    try:
        kept = json.loads(record.read_text())
        if {k: kept.get(k) for k in seen} == seen and isinstance(kept.get("sha256"), str):
            return kept["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # no record yet, or not one this function wrote: hash again
    logger.info("hashing %s (%.1f GB) once, to know its content", real.name, seen["size"] / 1e9)
    digest = sha256_of([real])
    atomic_write_json(record, {**seen, "sha256": digest})
    return digest


def remember_sha256(path: Path, digest: str, configured_cache: str | None = None) -> None:
    """Keep ``digest`` as the sha256 of a file just written from bytes hashed on the way (an
    alias's parts assembled), so that :func:`file_sha256` does not read it again."""
    real = path.resolve()
    atomic_write_json(_record(real, configured_cache), {**_seen(real), "sha256": digest})


def parts_sha256(spec: str, path: Path, configured_cache: str | None = None) -> tuple[str, ...]:
    """The sha256 of each file of a GGUF named by its path (a split model's parts, found beside
    the first, in order), each hashed once: a member's identity is its content, whatever path or
    name reaches it."""
    parts = split_parts(path)
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise OptionError(
            f"member {spec!r}: {parts[0].name} is split in {len(parts)} files and "
            f"{', '.join(missing)} is missing beside it; download the model again"
        )
    return tuple(file_sha256(part, configured_cache) for part in parts)


def checked_digest(spec: str, path: Path, expected: str, configured_cache: str | None) -> str:
    """``expected`` (the digest a store names a file by), once the file's bytes are seen to
    have it: a file damaged or replaced in the store fails here, not as odd answers later."""
    found = file_sha256(path, configured_cache)
    if found != expected.lower():
        raise OptionError(
            f"member {spec!r}: {path} is named by sha256 {expected[:12]}... but its bytes hash to "
            f"{found[:12]}...; the file is damaged or was replaced: download the model again"
        )
    return found


def named_sha256(spec: str, path: Path, configured_cache: str | None) -> str:
    """The sha256 of a file in the Hugging Face cache or LM Studio's folder: a hub cache file
    links to a blob named by its sha256 (checked once against it); others are hashed once."""
    target = Path(os.readlink(path)).name if path.is_symlink() else ""
    if len(target) == 64 and all(c in "0123456789abcdef" for c in target):
        return checked_digest(spec, path, target, configured_cache)
    return file_sha256(path, configured_cache)


def pick_gguf(
    spec: str, files: list[str], quant: str | None, where: str, name_of: Callable[[str], str]
) -> str:
    """The model file ``quant`` names among ``files`` (paths relative to the repository), by
    llama.cpp's rule (the quantization followed by ``.`` or ``-`` in the name, any case); with
    no ``quant``, the Q4_K_M file, else the only GGUF. A split model counts by its first part.
    ``name_of``: the member name of a file, suggested when the choice is the user's."""
    models = sorted(f for f in files if is_model_file(f) and split_index(f) == 1)
    if not models:
        raise OptionError(f"member {spec!r}: {where} holds no GGUF model file")
    wanted = quant or DEFAULT_QUANT
    found = [f for f in models if matches_quant(f, wanted)]
    if found:
        return found[0]
    have = ", ".join(quant_tag(f) or Path(f).name for f in models)
    if quant:
        raise OptionError(f"member {spec!r}: {where} has no {quant} GGUF (it has: {have}); name one of those")
    if len(models) == 1:
        return models[0]
    raise OptionError(
        f"member {spec!r}: {where} has {len(models)} GGUF files and none is {DEFAULT_QUANT} "
        f"(it has: {have}); name one, e.g. {name_of(models[0])}"
    )


def plain_parts(spec: str, ref: str, form: str) -> list[str]:
    """``ref``'s ``/``-separated parts, refused in one line where one could lead out of the
    store's folder or name nothing: an absolute path (a leading ``/``), an empty part, ``.`` or
    ``..``, a backslash (Windows' separator), a NUL. One trailing ``/`` is forgiven."""
    parts = ref.removesuffix("/").split("/")
    bad = next((p for p in parts if p in ("", ".", "..") or "\\" in p or "\0" in p), None)
    if bad is not None:
        what = "an empty part (a leading or doubled /)" if bad == "" else f"the part {bad!r}"
        raise OptionError(f"member {spec!r} has {what}, which a store's name cannot have: write {form}")
    return parts


def inside_store(spec: str, root: Path, path: Path) -> Path:
    """``path``, refused unless its name keeps it inside the store's folder ``root``.

    Checked on the names with every ``..`` folded away, not on where links lead: the links a
    store makes itself (an LM Studio file linking into the hub cache, a hub snapshot's files
    linking to its blobs) point elsewhere by design, and keep working."""
    base = os.path.normpath(os.path.abspath(root))
    found = os.path.normpath(os.path.abspath(path))
    if os.path.commonpath([base, found]) != base:
        raise OptionError(f"member {spec!r} leads out of its store's folder {root}: name a model inside it")
    return path


def folder_state(folder: Path) -> str:
    """``folder`` as ``lm-eval-safe models`` says where it looked: with ``(missing)`` when it is
    not there, so an unset or mistyped variable shows."""
    return str(folder) if folder.is_dir() else f"{folder} (missing)"


def missing_parts(path: Path) -> list[Path]:
    """The parts of a split model that are not beside its first."""
    return [p for p in split_parts(path) if not p.is_file()]


def relative_files(folder: Path) -> list[str]:
    """Every file below ``folder``, as paths relative to it, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
