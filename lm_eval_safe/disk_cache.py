"""Crash-safe disk caches: an entry appears whole or not at all, and a damaged one is rebuilt.

Why: the backend caches work that takes seconds to minutes (de-quantized GGUF weights, union
vocabularies). A run can be killed at any instant, and data-parallel ranks build the same entry
at the same moment. A half-written file must never be read as valid, and two writers must never
write into each other's files. Three rules give that:

- **Write privately, publish atomically.** An entry is built under a unique temporary name in
  the destination folder (same file system, so the final ``rename`` is atomic), its data and
  folder are ``fsync``-ed, then it is renamed into place. A reader sees the old state or the
  whole new entry, never a part.
- **Verify on load.** Every entry carries a checksum of its contents (a header for a single
  file, a ``manifest.json`` for a folder). A missing, truncated or altered entry fails the check
  and is rebuilt, with a one-line warning naming it, instead of being loaded.
- **Last writer wins, harmlessly.** Two processes may build the same entry at once: each builds
  its own temporary copy; whichever renames first publishes, the other finds a valid entry and
  discards its copy. A folder build also takes an advisory lock (``flock``, released by the
  kernel when a process dies) so the second rank waits and reuses instead of building twice.

CRC-32 is the checksum: it detects truncation and damage (not tampering) at about 2.5 GB/s,
so verifying a 1 GB weights file costs well under a second next to loading it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_BLOB_MAGIC = b"lm-eval-safe-blob 1"
_CHUNK = 1 << 24


class DamagedEntry(ValueError):
    """A cache entry exists but fails verification (the message says how)."""


def cache_root(configured: str | None = None) -> Path:
    """``cache_dir=`` model arg, else ``$LM_EVAL_SAFE_CACHE``, else ``~/.cache/lm-eval-safe``."""
    root = configured or os.environ.get("LM_EVAL_SAFE_CACHE") or "~/.cache/lm-eval-safe"
    return Path(root).expanduser()


def _temp_name(path: Path) -> Path:
    """A name no other process or thread will choose, next to ``path`` (same file system)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def fsync_dir(folder: Path) -> None:
    """Make a rename or new file in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def crc32_of(path: Path) -> int:
    """CRC-32 of a file's bytes, streamed."""
    crc = 0
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Open a private temporary file that becomes ``path`` (fsync-ed, renamed) when the block
    ends normally; an exception in the block leaves ``path`` as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        with tmp.open("wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader or a crash never sees a partial file."""
    with atomic_file(path) as handle:
        handle.write(data)


def atomic_write_json(
    path: Path, data: Any, *, indent: int | None = None, sort_keys: bool = False
) -> None:
    """:func:`atomic_write_bytes` of ``data`` as UTF-8 JSON and a final newline: the one way
    this project writes a JSON file that a reader may open while it is being replaced, or that
    a killed run must not leave half-written. Values JSON lacks (paths, dtypes) are written
    as their ``str``."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, default=str, ensure_ascii=False)
    atomic_write_bytes(path, (text + "\n").encode("utf-8"))


# -- single-file entries -------------------------------------------------------------------


def write_blob(path: Path, payload: bytes) -> None:
    """Store ``payload`` at ``path`` behind a header holding its length and CRC-32."""
    header = b"%s %d %08x\n" % (_BLOB_MAGIC, len(payload), zlib.crc32(payload))
    atomic_write_bytes(path, header + payload)


def read_blob(path: Path) -> bytes:
    """The payload stored by :func:`write_blob`; :class:`DamagedEntry` if it does not verify,
    ``FileNotFoundError`` if there is none."""
    raw = path.read_bytes()
    head, newline, payload = raw.partition(b"\n")
    parts = head.split(b" ")
    if not newline or b" ".join(parts[:2]) != _BLOB_MAGIC or len(parts) != 4:
        raise DamagedEntry("no lm-eval-safe header")
    try:
        length, crc = int(parts[2]), int(parts[3], 16)
    except ValueError as exc:
        raise DamagedEntry("unreadable header") from exc
    if len(payload) != length:
        raise DamagedEntry(f"{len(payload)} bytes where the header says {length} (truncated?)")
    if zlib.crc32(payload) != crc:
        raise DamagedEntry("checksum mismatch")
    return payload


def cached_blob(path: Path, build: Callable[[], bytes], what: str) -> bytes:
    """``path``'s verified payload, or ``build()``'s, stored for next time.

    A damaged file is reported in one warning and replaced. Two processes building at once both
    write complete files under private names; the later rename wins and both are valid."""
    try:
        return read_blob(path)
    except FileNotFoundError:
        pass
    except DamagedEntry as exc:
        logger.warning("%s cache %s is damaged (%s); rebuilding it", what, path, exc)
    payload = build()
    write_blob(path, payload)
    return payload


def discard(path: Path, what: str, reason: str) -> None:
    """Drop an entry that verified but could not be used (e.g. an older layout), with a warning."""
    logger.warning("%s cache %s is unusable (%s); rebuilding it", what, path, reason)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# -- folder entries ------------------------------------------------------------------------


def write_manifest(folder: Path) -> None:
    """Record every file's size and CRC-32 in ``folder/manifest.json``; fsync files and folder."""
    files = {}
    for item in sorted(folder.iterdir()):
        if item.name == MANIFEST or not item.is_file():
            continue
        with item.open("rb") as handle:
            os.fsync(handle.fileno())
        files[item.name] = {"size": item.stat().st_size, "crc32": crc32_of(item)}
    manifest = folder / MANIFEST
    with manifest.open("w") as handle:
        json.dump({"format": 1, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(folder)


def folder_problem(folder: Path) -> str | None:
    """None when ``folder`` is a complete, intact entry; otherwise what is wrong with it."""
    if not folder.is_dir():
        return "missing"
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "no manifest: never finished"
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    for name, expected in files.items():
        item = folder / name
        if not item.is_file():
            return f"{name} is missing"
        size = item.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, expected {expected['size']}"
    for name, expected in files.items():  # sizes first: they are free
        if crc32_of(folder / name) != expected["crc32"]:
            return f"{name} fails its checksum"
    return None


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Advisory lock per entry so concurrent builders take turns; best effort (no fcntl: none)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: publishing stays safe, builders may just duplicate work
        yield
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # file systems without flock
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _publish(tmp: Path, folder: Path, what: str) -> None:
    """Rename the finished ``tmp`` to ``folder``; a valid entry already there wins, a damaged
    one is moved aside first (rename cannot replace a non-empty folder)."""
    for _ in range(5):
        try:
            os.rename(tmp, folder)
            fsync_dir(folder.parent)
            return
        except OSError:
            if not folder.exists():
                raise
        if folder_problem(folder) is None:  # another process published first
            shutil.rmtree(tmp, ignore_errors=True)
            return
        aside = _temp_name(folder)
        with contextlib.suppress(FileNotFoundError):
            os.rename(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"could not publish the {what} cache at {folder}")


def cached_folder(folder: Path, build: Callable[[Path], None], what: str) -> bool:
    """Make ``folder`` a verified entry, calling ``build(tmp)`` to fill a fresh folder if needed.

    Returns True when this call built it. ``build`` writes files into the empty folder it is
    given; the manifest, fsync and atomic publish are done here. A damaged entry is reported in
    one warning and rebuilt."""
    if folder_problem(folder) is None:
        return False
    with _build_lock(folder):
        problem = folder_problem(folder)
        if problem is None:  # built by another process while this one waited
            return False
        if problem != "missing":
            logger.warning("%s cache %s is damaged (%s); rebuilding it", what, folder, problem)
        tmp = _temp_name(folder)
        try:
            tmp.mkdir(parents=True)
            build(tmp)
            write_manifest(tmp)
            _publish(tmp, folder, what)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True
