"""``hf:ORG/REPO[:QUANT]``: a GGUF repository of the Hugging Face hub, as llama.cpp's ``-hf``
names it, from the hub cache huggingface_hub keeps (``models--ORG--REPO/snapshots/<revision>``
behind ``refs/main``, its files linking to blobs named by their sha256), downloaded into it
through huggingface_hub where the cache lacks the file and the hub may be used.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.gguf_info import is_model_file, quant_tag, split_index, split_parts
from lm_eval_safe.members.stores.files import (
    DEFAULT_QUANT,
    inside_store,
    missing_parts,
    pick_gguf,
    relative_files,
)

logger = logging.getLogger(__name__)

FORM = "hf:ORG/REPO[:QUANT], e.g. hf:bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"
#: an organisation or repository name as the hub allows it (huggingface_hub's
#: ``validate_repo_id``: letters, digits, ``_``, ``-``, ``.``, and neither ``--`` nor ``..``)
_NAME = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9_.-]{1,96}")
#: a quantization as llama.cpp's ``-hf`` takes it (``Q4_K_M``, ``UD-Q4_K_XL``, ``BF16``)
_QUANT = re.compile(r"(?!.*\.\.)[A-Za-z0-9_.-]+")


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


def hf_file(spec: str, ref: str) -> Path:
    """The GGUF file of ``ORG/REPO[:QUANT]`` in the hub cache, downloaded with huggingface_hub
    (every part of a split model) where the cache lacks it and the hub may be used."""
    repo, colon, quant = ref.partition(":")
    named = repo.split("/")
    if len(named) != 2 or not all(_NAME.fullmatch(p) and p[0] not in ".-" for p in named):
        raise OptionError(f"member {spec!r} is not a hub GGUF repository: write {FORM}")
    if colon and not _QUANT.fullmatch(quant):
        raise OptionError(f"member {spec!r}: {quant!r} is not a quantization (e.g. Q4_K_M): write {FORM}")
    cache = hf_cache_dir()
    snapshot = hf_snapshot(cache / f"models--{repo.replace('/', '--')}")
    problem = f"the Hugging Face cache {cache} has no snapshot of {repo}"
    if not cache.is_dir():
        problem = f"the Hugging Face cache {cache} does not exist"
    if snapshot is not None:
        try:
            picked = pick_gguf(spec, relative_files(snapshot), quant or None, f"the cached {repo}", _named(repo))
            chosen = inside_store(spec, cache, snapshot / picked)
            missing = missing_parts(chosen)
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
    chosen = Path(pick_gguf(spec, files, quant, f"the hub repository {repo}", _named(repo)))
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


def _named(repo: str) -> Callable[[str], str]:
    """A file's member name: the repository with the file's quantization."""

    def name_of(file: str) -> str:
        tag = quant_tag(file)
        return f"hf:{repo}:{tag}" if tag else f"hf:{repo}"

    return name_of


def hf_listing() -> Iterator[tuple[str, Path]]:
    """Every GGUF model in the hub cache: (its member name, its file)."""
    cache = hf_cache_dir()
    for folder in sorted(cache.glob("models--*--*")):
        snapshot = hf_snapshot(folder)
        if snapshot is None:
            continue
        repo = folder.name.removeprefix("models--").replace("--", "/", 1)
        for name in relative_files(snapshot):
            if is_model_file(name) and split_index(name) == 1:
                yield _named(repo)(name), snapshot / name
