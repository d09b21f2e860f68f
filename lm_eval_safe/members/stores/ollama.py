"""``ollama:NAME[:TAG]``: a model pulled by Ollama, as its manifest names its GGUF blob.

Ollama keeps ``manifests/<host>/<namespace>/<model>/<tag>`` (JSON: layers with a media type and
a digest) and ``blobs/sha256-<hex>``; the weights are the layer of type
``application/vnd.ollama.image.model``, a GGUF file loaded where it is.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.stores.files import inside_store

FORM = "ollama:NAME[:TAG], e.g. ollama:qwen2.5:1.5b"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL = "application/vnd.ollama.image.model"
#: layers that change what the model computes, which a GGUF member cannot carry
OLLAMA_REFUSED = {
    "application/vnd.ollama.image.adapter": "an adapter (LoRA) layer",
    "application/vnd.ollama.image.projector": "a projector (vision) layer",
}
#: a name part as Ollama's own parser takes it (letters, digits, ``_``, ``-``, ``.``; a host
#: may carry ``:port``): no spaces, no part that is empty or leads out of the store's folder
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")


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
    filled in (``registry.ollama.ai``, ``library``, ``latest``); ValueError for a name outside
    Ollama's grammar (its parts become folder names under ``manifests``)."""
    head, slash, last = ref.rpartition("/")
    model, colon, tag = last.partition(":")
    path = head.split("/") if slash else []
    if len(path) > 2 or (colon and not tag):
        raise ValueError(ref)
    named = [(_HOST if len(path) == 2 and i == 0 else _PART, p) for i, p in enumerate(path)]
    named += [(_PART, model)] + ([(_PART, tag)] if colon else [])
    if not all(rule.fullmatch(part) for rule, part in named):
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
        raise OptionError(
            f"member {spec!r} is not an Ollama name (letters, digits, '_', '-' and '.' in each "
            f"part, no spaces): write {FORM}"
        ) from None
    root = ollama_dir()
    pull = f"`ollama pull {shlex.quote(ollama_display(*parts).removesuffix(':latest'))}`"
    if not root.is_dir() and os.environ.get("OLLAMA_MODELS"):
        raise OptionError(
            f"member {spec!r}: OLLAMA_MODELS names {root}, which does not exist: set it to the "
            "folder Ollama keeps its models in (or unset it)"
        )
    if not root.is_dir():
        raise OptionError(
            f"member {spec!r}: Ollama's models folder {root} does not exist: install Ollama and "
            f"run {pull}, or set OLLAMA_MODELS to the folder it keeps its models in"
        )
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
        f"run {pull}"
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
    if algorithm != "sha256" or not re.fullmatch("[0-9a-fA-F]{64}", digest):
        raise OptionError(f"member {spec!r}: the Ollama manifest {manifest} names no sha256 blob; pull the model again")
    blob = inside_store(spec, ollama_dir(), manifest.parents[4] / "blobs" / f"sha256-{digest}")
    if not blob.is_file():
        raise OptionError(
            f"member {spec!r}: Ollama's manifest names the blob {blob.name}, which is missing; "
            f"run `ollama pull {shlex.quote(ref)}` again"
        )
    return blob, digest
