"""A member spec resolved, without loading anything: an alias of a small model shipped through
PyPI, a path to a ``.gguf`` file, a model in a store people keep GGUF files in (``ollama:``,
``hf:``, ``lmstudio:``: :mod:`lm_eval_safe.members.stores`), a local folder, or a hub id
(:func:`resolve_source`), with what an engine's loader needs of it and the one-line errors that
name the member.

Below every engine: each engine's loader takes the :class:`MemberSource` resolved here once
(:func:`lm_eval_safe.engines.load_members` checks every GGUF file before the first member loads).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.aliases import ALIASES, alias_sha256, resolve_alias
from lm_eval_safe.members.stores import resolve_store
from lm_eval_safe.members.stores.files import parts_sha256
from lm_eval_safe.members.stores.hub import hub_offline
from lm_eval_safe.model_args import STORE_PREFIXES, member_display_name


@dataclass(frozen=True)
class MemberSource:
    """Where a member's weights come from, resolved without loading anything."""

    spec: str
    name: str
    kind: str  # "gguf" | "folder" | "hub"
    location: str
    #: sha256 of each file of a GGUF (a split model's parts in order): its identity, whichever
    #: alias, path or store name reached it (empty only for a source made without
    #: :func:`resolve_source`)
    sha256: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"name": self.name, "spec": self.spec, "kind": self.kind, "location": self.location}
        if self.sha256:
            described["sha256"] = self.sha256[0] if len(self.sha256) == 1 else list(self.sha256)
        return described


def resolve_source(spec: str, configured_cache: str | None = None) -> MemberSource:
    """Decide what kind of member a spec is, failing in one line when it is none of them."""
    name = member_display_name(spec)
    key = spec.strip().lower()
    if key in ALIASES:
        path = resolve_alias(key, configured_cache)
        return MemberSource(spec, key, "gguf", str(path), (alias_sha256(key, path, configured_cache),))
    stored = resolve_store(spec, configured_cache)
    if stored is not None:  # kept as the store names it: a split's parts are found beside it
        return MemberSource(spec, name, "gguf", str(stored.path), stored.sha256)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise OptionError(f"member {spec!r}: no such .gguf file")
        real = path.resolve()
        return MemberSource(spec, name, "gguf", str(real), parts_sha256(spec, real, configured_cache))
    if path.is_dir():
        return MemberSource(spec, name, "folder", str(path.resolve()))
    if path.exists():
        raise OptionError(
            f"member {spec!r} is a file but not a .gguf; give a .gguf file or a model folder"
        )
    looks_like_hub = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if looks_like_hub:
        return MemberSource(spec, name, "hub", spec)
    raise OptionError(
        f"unknown member {spec!r}: give a local folder, a .gguf file, a hub id (org/name), "
        f"ollama:NAME[:TAG], hf:ORG/REPO[:QUANT], lmstudio:PUBLISHER/REPO[/FILE] or an alias "
        f"({', '.join(sorted(a for a in ALIASES if '-' in a))}); `lm-eval-safe models` lists them"
    )


def content_identity(source: MemberSource, config: Any = None) -> dict[str, Any]:
    """Identity of a member's weights without hashing gigabytes on every run: a GGUF's sha256
    (an alias's pinned one, a store's file's or a path's, each hashed once), so a name whose
    file changes (Ollama's ``latest``) is a new identity and the same file under two names (an
    alias, a path, a store's model) is one; a GGUF source made without :func:`resolve_source`:
    its file's name, size and mtime; a folder's file names, sizes and mtimes; a hub id's
    resolved commit (from the loaded ``config``, when transformers recorded it)."""
    if source.sha256:
        return {"sha256": source.sha256[0] if len(source.sha256) == 1 else list(source.sha256)}
    path = Path(source.location)
    if source.kind == "gguf":
        return _file_identity(path)
    if source.kind == "folder":
        files = sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file()
        )
        digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:20]
        return {"folder": path.name, "files": digest}
    revision = None if config is None else config._commit_hash
    return {"hub": source.spec, "revision": revision}


def _file_identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def earlier_identity(source: MemberSource) -> dict[str, Any] | None:
    """What :func:`content_identity` gave this member before every GGUF was identified by its
    content (an alias: its name and pinned sha256; a path: its file's name, size and mtime),
    for ``--use_cache`` to say that answers kept under it are not reused; None where it is
    unchanged (a store's model, a folder, a hub id)."""
    alias = ALIASES.get(source.spec.strip().lower())
    if alias is not None:
        return {"alias": source.name, "sha256": alias.sha256}
    if source.kind == "gguf" and not source.spec.strip().lower().startswith(STORE_PREFIXES):
        return _file_identity(Path(source.location))
    return None


GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what the gguf package's reader handles


def check_gguf_file(source: MemberSource) -> None:
    """Fail in one line naming the member when its file is not a GGUF this reader can load.

    The gguf reader's own message (``GGUF v3528099250; this reader handles v2 and v3``) names
    neither the member nor the file, and comes after the model class has been set up."""
    path = Path(source.location)
    with path.open("rb") as handle:
        head = handle.read(8)
    version = int.from_bytes(head[4:8], "little") if len(head) == 8 else None
    if head[:4] != GGUF_MAGIC or version not in GGUF_VERSIONS:
        found = f"starts with {head[:4]!r}" if head[:4] != GGUF_MAGIC else f"says version {version}"
        raise OptionError(
            f"member {source.spec!r}: {path} is not a valid GGUF file (it {found}; GGUF v2/v3 "
            f"expected); the file is damaged or of another format: download it again"
        )


@contextmanager
def loading_errors(source: MemberSource) -> Iterator[None]:
    """A checkpoint that cannot be read fails in one line naming the member (offline hub ids
    say what to do)."""
    try:
        yield
    except OSError as exc:
        if source.kind == "hub" and hub_offline():
            raise OptionError(
                f"member {source.spec!r} is not in the local hub cache and the hub is offline "
                "(HF_HUB_OFFLINE=1): download it once, or give a local folder or .gguf file"
            ) from exc
        raise OptionError(
            f"member {source.spec!r} could not be loaded: {str(exc).splitlines()[0]}"
        ) from exc
