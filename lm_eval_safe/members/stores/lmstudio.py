"""``lmstudio:PUBLISHER/REPO[/FILE]``: a model LM Studio downloaded, in its models folder
(``PUBLISHER/REPO/FILE.gguf``), found where LM Studio's own tools find it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.gguf_info import is_model_file, split_index
from lm_eval_safe.members.stores.files import (
    inside_store,
    missing_parts,
    pick_gguf,
    plain_parts,
    relative_files,
)

FORM = "lmstudio:PUBLISHER/REPO[/FILE], e.g. lmstudio:lmstudio-community/Qwen2.5-1.5B-Instruct-GGUF"


def lmstudio_home() -> Path:
    """LM Studio's home, as its own tools find it: the folder ``~/.lmstudio-home-pointer``
    names, else ``~/.cache/lm-studio`` where it exists (older installs), else ``~/.lmstudio``."""
    pointer = Path.home() / ".lmstudio-home-pointer"
    try:
        named = pointer.read_text(encoding="utf-8").strip()
    except OSError:
        named = ""
    if named:
        return Path(named).expanduser()
    legacy = Path.home() / ".cache" / "lm-studio"
    return legacy if legacy.is_dir() else Path.home() / ".lmstudio"


def lmstudio_dir() -> Path:
    """LM Studio's models folder: the ``downloadsFolder`` its ``settings.json`` names (the
    folder chosen in its My Models tab), else ``models`` in its home."""
    home = lmstudio_home()
    try:
        chosen = json.loads((home / "settings.json").read_text(encoding="utf-8")).get("downloadsFolder")
    except (OSError, ValueError, AttributeError):
        chosen = None
    return Path(chosen).expanduser() if isinstance(chosen, str) and chosen else home / "models"


def lmstudio_file(spec: str, ref: str) -> Path:
    """``PUBLISHER/REPO[/FILE]`` in LM Studio's folder; without FILE, the Q4_K_M file, else
    the only GGUF."""
    parts = plain_parts(spec, ref, FORM)
    if len(parts) < 2:
        raise OptionError(f"member {spec!r} is not an LM Studio name: write {FORM}")
    root = lmstudio_dir()
    if not root.is_dir():
        raise OptionError(
            f"member {spec!r}: LM Studio's models folder {root} does not exist: download the model "
            "in LM Studio first (or set its folder in LM Studio's My Models tab)"
        )
    folder = inside_store(spec, root, root / parts[0] / parts[1])
    if not folder.is_dir():
        have = ", ".join(sorted({f"{p.parent.parent.name}/{p.parent.name}" for p in root.glob("*/*/*.gguf")})) or "nothing"
        raise OptionError(
            f"member {spec!r}: LM Studio's models folder {root} has no {parts[0]}/{parts[1]} "
            f"(it has: {have}); download it in LM Studio first"
        )
    if len(parts) > 2:
        name = "/".join(parts[2:])
        chosen = inside_store(spec, root, folder / (name if name.lower().endswith(".gguf") else f"{name}.gguf"))
        if not chosen.is_file():
            have = ", ".join(f for f in relative_files(folder) if is_model_file(f)) or "no GGUF"
            raise OptionError(f"member {spec!r}: {folder} has no {chosen.name} (it has: {have})")
    else:
        repo = f"{parts[0]}/{parts[1]}"
        chosen = folder / pick_gguf(spec, relative_files(folder), None, f"LM Studio's {repo}", _named(repo))
    missing = missing_parts(chosen)
    if missing:
        raise OptionError(
            f"member {spec!r}: {chosen.name} is split and {', '.join(p.name for p in missing)} is missing "
            "beside it; download the model again"
        )
    return chosen


def _named(repo: str) -> Callable[[str], str]:
    """A file's member name: the folder with the file's name."""
    return lambda file: f"lmstudio:{repo}/{Path(file).name}"


def lmstudio_listing() -> Iterator[tuple[str, Path]]:
    """Every GGUF model in LM Studio's folder: (its member name, its file); the name without
    FILE for the file a folder gives without one."""
    root = lmstudio_dir()
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        repo = folder.relative_to(root).as_posix()
        files = relative_files(folder)
        try:
            default: str | None = pick_gguf(repo, files, None, repo, _named(repo))
        except OptionError:
            default = None
        for name in files:
            if is_model_file(name) and split_index(name) == 1:
                yield (f"lmstudio:{repo}" if name == default else f"lmstudio:{repo}/{name}"), folder / name
