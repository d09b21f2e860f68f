"""Stores as their programs lay them out, built from GGUF files for the tests: an Ollama
manifest and its blob named by its sha256, a Hugging Face cache snapshot behind ``refs/main``
whose files link to sha256-named blobs, LM Studio's folders; small GGUF files written with the
``gguf`` package, and a real GGUF rewritten as llama.cpp's split files."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

OLLAMA_MODEL = "application/vnd.ollama.image.model"


def sha256(path: Path) -> str:
    """The sha256 a store names a file by, computed here apart from the package's own."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def link(source: Path, target: Path, symbolic: bool = False) -> None:
    """``target`` becomes ``source``'s bytes without a copy: a hard link where both lie on one
    file system (unless ``symbolic``), else a symbolic link (the stores' resolvers follow
    either)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if symbolic:
            raise OSError("a symbolic link asked for")
        os.link(source, target)
    except OSError:
        target.symlink_to(source.resolve())


def tiny_gguf(path: Path, *, pre: str = "smollm", tokens: int = 7, split: int = 0) -> Path:
    """A small valid GGUF (three float tensors, a gpt2-style vocabulary); ``split``: tensors per
    part, the parts written as llama.cpp names them. Returns the (first) file."""
    import numpy as np
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, "llama", split_max_tensors=split)
    writer.add_name(path.stem)
    writer.add_file_type(15)  # Q4_K_M, as llama.cpp numbers file types
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    for i in range(3):
        writer.add_tensor(f"blk.{i}.w", np.full((8,), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.with_name(f"{path.stem}-00001-of-{(3 + split - 1) // split:05d}.gguf") if split else path


def ollama_store(
    root: Path,
    name: str,
    gguf: Path,
    *,
    tag: str = "latest",
    namespace: str = "library",
    layers: tuple[dict[str, Any], ...] = (),
    digest: str | None = None,
    symbolic: bool = False,
) -> Path:
    """An Ollama model as ``ollama pull`` leaves it: the GGUF blob named by its sha256 (or by
    ``digest``) and a manifest naming it beside a template layer; returns the manifest."""
    digest = digest or sha256(gguf)
    blob = root / "blobs" / f"sha256-{digest}"
    if not blob.exists():
        link(gguf, blob, symbolic)
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64, "size": 2},
        "layers": [
            {"mediaType": OLLAMA_MODEL, "digest": f"sha256:{digest}", "size": gguf.stat().st_size},
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64, "size": 10},
            *layers,
        ],
    }
    manifest.write_text(json.dumps(body))
    return manifest


def hf_store(cache: Path, repo: str, files: dict[str, Path], revision: str = "a" * 40) -> Path:
    """A hub cache repository as huggingface_hub writes it: blobs named by their sha256, the
    snapshot's files linking to them, ``refs/main`` naming the snapshot; returns the snapshot."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / revision
    for relative, source in files.items():
        blob = folder / "blobs" / sha256(source)
        if not blob.exists():
            link(source, blob)
        target = snapshot / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blob, target.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    return snapshot


def split_in_two(source: Path, folder: Path, stem: str) -> list[Path]:
    """``source`` as llama.cpp's split files, written by the gguf package's own writer."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from lm_eval_safe.members.gguf_info import split_parts

    reader = GGUFReader(source)
    folder.mkdir(parents=True)
    writer = GGUFWriter(folder / f"{stem}.gguf", reader.fields["general.architecture"].contents(),
                        split_max_tensors=len(reader.tensors) // 2 + 1)  # fmt: skip
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return split_parts(folder / f"{stem}-00001-of-00002.gguf")
