"""The folders people already keep GGUF models in, as member names: Ollama
(``ollama:NAME[:TAG]``), the Hugging Face cache (``hf:ORG/REPO[:QUANT]``, llama.cpp's ``-hf``
convention) and LM Studio (``lmstudio:PUBLISHER/REPO[/FILE]``).

Why here, below every engine: a laptop user's models sit in these stores under names the store
gives them (Ollama's blobs are named by their sha256); each name is resolved once
(:func:`lm_eval_safe.sources.resolve_source` calls :func:`resolve_store`) to the file as it is,
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

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_safe.disk_cache import atomic_write_json, cache_root
from lm_eval_safe.errors import OptionError
from lm_eval_safe.gguf_info import is_model_file, matches_quant, quant_tag, split_index, split_parts
from lm_eval_safe.model_args import STORE_PREFIXES

logger = logging.getLogger(__name__)

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default


@dataclass(frozen=True)
class StoreFile:
    """A store's GGUF file: the path to load (a split model's first part, where llama.cpp finds
    the others) and the sha256 of each part's bytes, in order."""

    path: Path
    sha256: tuple[str, ...]


def store_of(spec: str) -> str | None:
    """The store a member spec names (``ollama``, ``hf``, ``lmstudio``), or None."""
    key = spec.strip().lower()
    return next((p.rstrip(":") for p in STORE_PREFIXES if key.startswith(p)), None)


def resolve_store(spec: str, configured_cache: str | None = None) -> StoreFile | None:
    """The file a store name means, checked (None when ``spec`` names no store): one line
    saying what to do when the store lacks it."""
    store = store_of(spec)
    if store is None:
        return None
    ref = spec.strip().split(":", 1)[1].strip()
    if not ref:
        raise OptionError(f"member {spec!r} names no model: write {_FORMS[store]}")
    if store == "ollama":
        path, digest = ollama_blob(spec, ref)
        return StoreFile(path, (checked_digest(spec, path, digest, configured_cache),))
    path = hf_file(spec, ref) if store == "hf" else lmstudio_file(spec, ref)
    return StoreFile(path, tuple(named_sha256(spec, part, configured_cache) for part in split_parts(path)))


_FORMS = {
    "ollama": "ollama:NAME[:TAG], e.g. ollama:qwen2.5:1.5b",
    "hf": "hf:ORG/REPO[:QUANT], e.g. hf:bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
    "lmstudio": "lmstudio:PUBLISHER/REPO[/FILE], e.g. lmstudio:lmstudio-community/Qwen2.5-1.5B-Instruct-GGUF",
}


# -- sha256 ------------------------------------------------------------------------------------


def file_sha256(path: Path, configured_cache: str | None = None) -> str:
    """The sha256 of a file's bytes, hashed once: the result is kept under the cache folder
    with the file's size and time of change, and reused while they stay the same (hashing runs
    at about 1 GB/s: seconds for a model of several GB, too long to repeat on every run)."""
    from lm_eval_safe.aliases import sha256_of

    real = path.resolve()
    stat = real.stat()
    record = cache_root(configured_cache) / "sha256" / f"{hashlib.sha1(str(real).encode()).hexdigest()}.json"
    seen = {"path": str(real), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        kept = json.loads(record.read_text())
        if {k: kept.get(k) for k in seen} == seen and isinstance(kept.get("sha256"), str):
            return kept["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # no record yet, or not one this function wrote: hash again
    logger.info("hashing %s (%.1f GB) once, to know its content", real.name, stat.st_size / 1e9)
    digest = sha256_of([real])
    atomic_write_json(record, {**seen, "sha256": digest})
    return digest


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


# -- choosing a file in a folder ---------------------------------------------------------------


def pick_gguf(spec: str, files: list[str], quant: str | None, where: str) -> str:
    """The model file ``quant`` names among ``files`` (paths relative to the repository), by
    llama.cpp's rule (the quantization followed by ``.`` or ``-`` in the name, any case); with
    no ``quant``, the Q4_K_M file, else the only GGUF. A split model counts by its first part."""
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
        f"(it has: {have}); name one, e.g. {_with_choice(spec.strip(), models[0])}"
    )


def _with_choice(spec: str, file: str) -> str:
    if store_of(spec) == "lmstudio":
        return f"{spec}/{Path(file).name}"
    tag = quant_tag(file)
    return f"{spec}:{tag}" if tag else spec


def _missing_parts(path: Path) -> list[Path]:
    return [p for p in split_parts(path) if not p.is_file()]


# -- Ollama ------------------------------------------------------------------------------------

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL = "application/vnd.ollama.image.model"
#: layers that change what the model computes, which a GGUF member cannot carry
OLLAMA_REFUSED = {
    "application/vnd.ollama.image.adapter": "an adapter (LoRA) layer",
    "application/vnd.ollama.image.projector": "a projector (vision) layer",
}


def ollama_dir() -> Path:
    """Ollama's models folder: ``$OLLAMA_MODELS``, else ``~/.ollama/models``, else the Linux
    service install's ``/usr/share/ollama/.ollama/models`` where only that one exists."""
    configured = os.environ.get("OLLAMA_MODELS")
    if configured:
        return Path(configured).expanduser()
    home = Path.home() / ".ollama" / "models"
    service = Path("/usr/share/ollama/.ollama/models")
    return service if not home.is_dir() and service.is_dir() else home


def ollama_parts(ref: str) -> tuple[str, str, str, str]:
    """``[HOST/][NAMESPACE/]MODEL[:TAG]`` as (host, namespace, model, tag), Ollama's defaults
    filled in (``registry.ollama.ai``, ``library``, ``latest``)."""
    head, slash, last = ref.rpartition("/")
    model, colon, tag = last.partition(":")
    path = [p for p in head.split("/") if p] if slash else []
    if not model or len(path) > 2 or (colon and not tag):
        raise ValueError(ref)
    host = path[0] if len(path) == 2 else OLLAMA_REGISTRY
    namespace = path[-1] if path else "library"
    return host, namespace, model, tag or "latest"


def ollama_display(host: str, namespace: str, model: str, tag: str) -> str:
    """A model's name as ``ollama list`` shows it (``qwen2.5:1.5b``, ``user/model:latest``)."""
    if host == OLLAMA_REGISTRY:
        return f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def ollama_manifests(root: Path) -> Iterator[tuple[str, Path]]:
    """Every model the store holds: (its name as ``ollama list`` shows it, its manifest)."""
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        if manifest.is_file():
            host, namespace, model, tag = manifest.parts[-4:]
            yield ollama_display(host, namespace, model, tag), manifest


def ollama_manifest(spec: str, ref: str) -> Path:
    """The manifest of ``ref`` in the store (names match in any case, as Ollama's do)."""
    try:
        parts = ollama_parts(ref)
    except ValueError:
        raise OptionError(f"member {spec!r} is not an Ollama name: write {_FORMS['ollama']}") from None
    root = ollama_dir()
    exact = root.joinpath("manifests", *parts)
    if exact.is_file():
        return exact
    wanted = ollama_display(*parts).lower()
    held = list(ollama_manifests(root))
    for name, manifest in held:
        if name.lower() == wanted:
            return manifest
    have = ", ".join(name for name, _ in held) or "nothing"
    elsewhere = not held and not os.environ.get("OLLAMA_MODELS")
    where = " (set OLLAMA_MODELS where Ollama keeps its models elsewhere)" if elsewhere else ""
    raise OptionError(
        f"member {spec!r}: Ollama's store {root} has no {ollama_display(*parts)} (it has: {have}){where}; "
        f"run `ollama pull {ollama_display(*parts).removesuffix(':latest')}`"
    )


def ollama_layers(spec: str, manifest: Path) -> list[dict[str, Any]]:
    """The layers a manifest lists; a manifest that is not Ollama's JSON fails in one line."""
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
            raise TypeError("layers is not a list of objects")
    except (ValueError, KeyError, TypeError) as exc:
        raise OptionError(
            f"member {spec!r}: the Ollama manifest {manifest} is not a manifest's JSON "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); pull the model again"
        ) from None
    return layers


def ollama_blob(spec: str, ref: str) -> tuple[Path, str]:
    """The GGUF blob of an Ollama model and the sha256 its manifest names it by."""
    manifest = ollama_manifest(spec, ref)
    layers = ollama_layers(spec, manifest)
    for layer in layers:
        what = OLLAMA_REFUSED.get(str(layer.get("mediaType")))
        if what is not None:
            raise OptionError(
                f"member {spec!r}: this Ollama model has {what} on top of its weights, which an "
                "ensemble member cannot apply; use the model it is built on"
            )
    weights = [layer for layer in layers if layer.get("mediaType") == OLLAMA_MODEL]
    if len(weights) != 1:
        kinds = ", ".join(sorted({str(layer.get("mediaType", "?")).rsplit(".", 1)[-1] for layer in layers}))
        raise OptionError(
            f"member {spec!r}: this Ollama model has {len(weights)} GGUF weight layers (its layers: "
            f"{kinds or 'none'}); one is needed: a model Ollama keeps in another format cannot be a member"
        )
    algorithm, _, digest = str(weights[0].get("digest", "")).partition(":")
    if algorithm != "sha256" or len(digest) != 64:
        raise OptionError(f"member {spec!r}: the Ollama manifest {manifest} names no sha256 blob; pull the model again")
    blob = manifest.parents[4] / "blobs" / f"sha256-{digest}"
    if not blob.is_file():
        raise OptionError(
            f"member {spec!r}: Ollama's manifest names the blob {blob.name}, which is missing; "
            f"run `ollama pull {ref}` again"
        )
    return blob, digest


# -- the Hugging Face cache ---------------------------------------------------------------------


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set to what huggingface_hub reads as true."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hf_cache_dir() -> Path:
    """The hub cache, by huggingface_hub's rules (read now, not when it was imported)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "huggingface" / "hub"


def hf_snapshot(repo_folder: Path) -> Path | None:
    """The snapshot the cache's ``refs/main`` points at (else any ref's), as llama.cpp and
    huggingface_hub take it; None if the repository has none."""
    refs = repo_folder / "refs"
    names = sorted(refs.iterdir(), key=lambda p: p.name != "main") if refs.is_dir() else []
    for ref in names:
        if ref.is_file():
            snapshot = repo_folder / "snapshots" / ref.read_text().strip()
            if snapshot.is_dir():
                return snapshot
    return None


def _relative_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def hf_file(spec: str, ref: str) -> Path:
    """The GGUF file of ``ORG/REPO[:QUANT]`` in the hub cache, downloaded with huggingface_hub
    (every part of a split model) where the cache lacks it and the hub may be used."""
    repo, _, quant = ref.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise OptionError(f"member {spec!r} is not a hub GGUF repository: write {_FORMS['hf']}")
    cache = hf_cache_dir()
    snapshot = hf_snapshot(cache / f"models--{repo.replace('/', '--')}")
    problem = f"the Hugging Face cache {cache} has no snapshot of {repo}"
    if snapshot is not None:
        try:
            chosen = snapshot / pick_gguf(spec, _relative_files(snapshot), quant or None, f"the cached {repo}")
            missing = _missing_parts(chosen)
            if not missing:
                return chosen
            problem = f"the cached {repo} lacks {', '.join(p.name for p in missing)} of {chosen.name}"
        except OptionError as exc:
            if hub_offline():
                raise
            problem = str(exc)
    if hub_offline():
        raise OptionError(
            f"member {spec!r}: {problem}, and HF_HUB_OFFLINE is set: download it once "
            f"(`hf download {repo} --include '*{quant or DEFAULT_QUANT}*'`) or unset HF_HUB_OFFLINE"
        )
    return _hf_download(spec, repo, quant or None, cache)


def _hf_download(spec: str, repo: str, quant: str | None, cache: Path) -> Path:
    """Every part of the chosen GGUF through huggingface_hub, into ``cache``."""
    from huggingface_hub import HfApi, hf_hub_download

    try:  # one request (list_repo_files retries an unreachable hub for half a minute)
        files = [sibling.rfilename for sibling in HfApi().model_info(repo).siblings or []]
    except Exception as exc:  # huggingface_hub raises its own errors and its HTTP client's
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OptionError(
            f"member {spec!r}: {repo} is not in the Hugging Face cache {cache} and the hub could "
            f"not be asked for it ({first[:160]})"
        ) from exc
    chosen = Path(pick_gguf(spec, files, quant, f"the hub repository {repo}"))
    logger.info("downloading %s from %s", chosen, repo)
    try:
        paths = [
            Path(hf_hub_download(repo, str(part), cache_dir=str(cache)))
            for part in split_parts(chosen)
        ]
    except Exception as exc:  # as above: a failed transfer names the file and the cause
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OptionError(f"member {spec!r}: downloading {chosen} of {repo} failed ({first[:160]})") from exc
    return paths[0]


def hf_listing() -> Iterator[tuple[str, Path]]:
    """Every GGUF model in the hub cache: (its member name, its file)."""
    cache = hf_cache_dir()
    for folder in sorted(cache.glob("models--*--*")):
        snapshot = hf_snapshot(folder)
        if snapshot is None:
            continue
        repo = folder.name.removeprefix("models--").replace("--", "/", 1)
        for name in _relative_files(snapshot):
            if is_model_file(name) and split_index(name) == 1:
                tag = quant_tag(name)
                yield (f"hf:{repo}:{tag}" if tag else f"hf:{repo}"), snapshot / name


# -- LM Studio -----------------------------------------------------------------------------------


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
    parts = [p for p in ref.split("/") if p]
    if len(parts) < 2:
        raise OptionError(f"member {spec!r} is not an LM Studio name: write {_FORMS['lmstudio']}")
    root = lmstudio_dir()
    folder = root / parts[0] / parts[1]
    if not folder.is_dir():
        have = ", ".join(sorted({f"{p.parent.parent.name}/{p.parent.name}" for p in root.glob("*/*/*.gguf")})) or "nothing"
        raise OptionError(
            f"member {spec!r}: LM Studio's models folder {root} has no {parts[0]}/{parts[1]} "
            f"(it has: {have}); download it in LM Studio first"
        )
    if len(parts) > 2:
        name = "/".join(parts[2:])
        chosen = folder / (name if name.lower().endswith(".gguf") else f"{name}.gguf")
        if not chosen.is_file():
            have = ", ".join(f for f in _relative_files(folder) if is_model_file(f)) or "no GGUF"
            raise OptionError(f"member {spec!r}: {folder} has no {chosen.name} (it has: {have})")
    else:
        chosen = folder / pick_gguf(spec, _relative_files(folder), None, f"LM Studio's {parts[0]}/{parts[1]}")
    missing = _missing_parts(chosen)
    if missing:
        raise OptionError(
            f"member {spec!r}: {chosen.name} is split and {', '.join(p.name for p in missing)} is missing "
            "beside it; download the model again"
        )
    return chosen


def lmstudio_listing() -> Iterator[tuple[str, Path]]:
    """Every GGUF model in LM Studio's folder: (its member name, its file); the name without
    FILE for the file a folder gives without one."""
    root = lmstudio_dir()
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        repo = folder.relative_to(root).as_posix()
        files = _relative_files(folder)
        try:
            default: str | None = pick_gguf(repo, files, None, repo)
        except OptionError:
            default = None
        for name in files:
            if is_model_file(name) and split_index(name) == 1:
                yield (f"lmstudio:{repo}" if name == default else f"lmstudio:{repo}/{name}"), folder / name


# -- what this machine holds -----------------------------------------------------------------------


@dataclass(frozen=True)
class Listed:
    """One model ``lm-eval-safe models`` lists."""

    name: str  # what to type in members=
    source: str  # alias, ollama, hf, lmstudio
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
    from lm_eval_safe.gguf_info import GGUFFormatError, read_header

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
    here, Ollama's models, GGUF files in the hub cache and in LM Studio's folder."""
    from lm_eval_safe.aliases import ALIASES, installed_alias_parts, models_dir

    listed = []
    first_names = {id(alias): name for name, alias in reversed(ALIASES.items())}  # not the short ones
    for alias in sorted(first_names.values()):
        local = models_dir(configured_cache) / ALIASES[alias].file
        wheels = installed_alias_parts(alias)
        if local.is_file():
            listed.append(_described(alias, "alias", local))
        elif wheels is not None:
            # read from the first wheel part (the header comes first); assembled on first use
            listed.append(_described(alias, "alias", wheels[0], sum(p.stat().st_size for p in wheels)))
        else:
            listed.append(Listed(alias, "alias", None, None, note=f"not installed: {ALIASES[alias].pip_command()}"))
    for name, _ in ollama_manifests(ollama_dir()):
        try:
            blob, _ = ollama_blob(f"ollama:{name}", name)
        except OptionError as exc:
            listed.append(Listed(f"ollama:{name}", "ollama", None, None, note=str(exc).split(": ", 1)[-1]))
            continue
        listed.append(_described(f"ollama:{name}", "ollama", blob))
    listed += [_described(name, "hf", path) for name, path in hf_listing()]
    listed += [_described(name, "lmstudio", path) for name, path in lmstudio_listing()]
    return listed


def store_folders() -> dict[str, Path]:
    """Where each store was looked for (``lm-eval-safe models`` says so under its table)."""
    return {"ollama": ollama_dir(), "hf": hf_cache_dir(), "lmstudio": lmstudio_dir()}
