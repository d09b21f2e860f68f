"""What a GGUF file says about itself, read from its header alone; llama.cpp's names for split
files and quantizations; and a split model joined into one file for transformers.

Why a reader of our own: ``lm-eval-safe models`` shows the architecture, quantization and
tokenizer of every GGUF a machine holds, and resolving a member needs a file's split count.
The ``gguf`` package's reader turns every metadata value into numpy arrays (a 262k-token
vocabulary takes seconds); walking the header with ``struct`` and skipping the arrays' items
takes a fraction of that, and reads nothing of the weights.

The split naming (``NAME-00001-of-00003.gguf``) and the quantization tag of a file name
(``...-Q4_K_M.gguf``) are llama.cpp's (``llama_split_path``, ``common/download.cpp``), so a
repository or folder picks the file llama.cpp's ``-hf`` would.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lm_eval_safe.errors import UserError

GGUF_MAGIC = b"GGUF"
#: GGUF value types: struct formats of the fixed-size ones (8 is a string, 9 an array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # general.alignment when a file does not say

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")
#: files of a GGUF repository that are not a language model (llama.cpp skips them as well)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


class GGUFFormatError(UserError, ValueError):
    """The bytes are not a GGUF header this reader understands (the message says where)."""


@dataclass
class GGUFHeader:
    """A GGUF file's metadata (arrays as their lengths) and where its parts lie."""

    version: int
    values: dict[str, Any]  # scalar and string metadata
    array_lengths: dict[str, int]  # array metadata: the number of items
    kv_spans: list[tuple[str, int, int]] = field(repr=False)  # each key's bytes: (key, start, end)
    tensors: list[tuple[bytes, int]] = field(repr=False)  # tensor info up to its offset, offset
    data_start: int = 0

    @property
    def alignment(self) -> int:
        return int(self.values.get("general.alignment", DEFAULT_ALIGNMENT))

    @property
    def split_count(self) -> int:
        return int(self.values.get("split.count", 1))

    @property
    def architecture(self) -> str | None:
        return self.values.get("general.architecture")

    @property
    def quantization(self) -> str | None:
        """The file type llama.cpp wrote (``Q4_K_M``), from ``general.file_type``."""
        from gguf import LlamaFileType

        code = self.values.get("general.file_type")
        try:
            return LlamaFileType(int(code)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (TypeError, ValueError):
            return None

    @property
    def vocab_size(self) -> int | None:
        return self.array_lengths.get("tokenizer.ggml.tokens")

    def tokenizer_family(self) -> str:
        """The tokenizer's kind and pre-tokenizer with its size (``gpt2/smollm 49152``):
        two members share a tokenizer only if these are equal."""
        kind = self.values.get("tokenizer.ggml.model", "?")
        pre = self.values.get("tokenizer.ggml.pre")
        name = kind if pre in (None, "", "default") else f"{kind}/{pre}"
        return f"{name} {self.vocab_size}" if self.vocab_size else name


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file (v2 or v3), without reading its weights."""
    with path.open("rb") as handle:
        size = path.stat().st_size
        if size < 24:
            raise GGUFFormatError(f"{path} is too short for a GGUF header ({size} bytes)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return _parse(view, path)


def _parse(view: Any, path: Path) -> GGUFHeader:
    if view[:4] != GGUF_MAGIC:
        raise GGUFFormatError(f"{path} does not start with GGUF")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", view, 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"{path} is GGUF v{version}; v2 and v3 are read")
    pos = 24

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", view, at)
        end = at + 8 + length
        if end > len(view):
            raise GGUFFormatError(f"{path}: a string runs past the end of the file")
        return bytes(view[at + 8 : end]).decode("utf-8", errors="replace"), end

    def skip(kind: int, at: int, count: int) -> int:
        if kind in _SCALARS:
            return at + count * struct.calcsize(_SCALARS[kind])
        if kind == _STRING:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", view, at)
                at += 8 + length
            return at
        if kind == _ARRAY:
            for _ in range(count):
                inner, inner_count = struct.unpack_from("<IQ", view, at)
                at = skip(inner, at + 12, inner_count)
            return at
        raise GGUFFormatError(f"{path}: unknown metadata type {kind}")

    values: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    spans: list[tuple[str, int, int]] = []
    try:
        for _ in range(n_kv):
            start = pos
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", view, pos)
            pos += 4
            if kind in _SCALARS:
                (values[key],) = struct.unpack_from("<" + _SCALARS[kind], view, pos)
                pos += struct.calcsize(_SCALARS[kind])
            elif kind == _STRING:
                values[key], pos = string(pos)
            elif kind == _ARRAY:
                inner, count = struct.unpack_from("<IQ", view, pos)
                lengths[key] = count
                pos = skip(inner, pos + 12, count)
            else:
                raise GGUFFormatError(f"{path}: unknown metadata type {kind} for {key!r}")
            spans.append((key, start, pos))
        tensors = []
        for _ in range(n_tensors):
            start = pos
            _, pos = string(pos)
            (dims,) = struct.unpack_from("<I", view, pos)
            pos += 4 + 8 * dims + 4
            (offset,) = struct.unpack_from("<Q", view, pos)
            tensors.append((bytes(view[start:pos]), offset))
            pos += 8
    except struct.error as exc:
        raise GGUFFormatError(f"{path}: the header is cut short ({exc})") from exc
    header = GGUFHeader(version, values, lengths, spans, tensors)
    header.data_start = -(-pos // header.alignment) * header.alignment
    return header


# -- names -------------------------------------------------------------------------------------


def split_parts(path: Path) -> list[Path]:
    """Every file of a split model in order, named as llama.cpp names them beside the first
    (``NAME-00001-of-00003.gguf``): ``[path]`` for a file whose name says it is whole."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    return [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def split_index(name: str) -> int:
    """1 for a whole file or the first of a split, the part's number otherwise."""
    match = SPLIT_NAME.match(Path(name).name)
    return 1 if match is None else int(match["index"])


def quant_tag(name: str) -> str | None:
    """The quantization a file's name ends with, uppercase (``...-q4_k_m.gguf`` -> ``Q4_K_M``),
    as llama.cpp reads it; None if the name has none."""
    stem = Path(name).name
    match = SPLIT_NAME.match(stem)
    stem = match["prefix"] if match else stem.removesuffix(".gguf")
    found = _TAG.search(stem)
    return found.group(1).upper() if found else None


def is_model_file(name: str) -> bool:
    """A ``.gguf`` that is a language model, not a vision projector, importance matrix or
    draft head that repositories keep beside it."""
    base = Path(name).name
    return base.lower().endswith(".gguf") and not any(word in base for word in _NOT_MODELS)


def matches_quant(name: str, quant: str) -> bool:
    """llama.cpp's rule for ``-hf REPO:QUANT``: the quantization followed by ``.`` or ``-``
    anywhere in the file's path, in any case."""
    return re.search(re.escape(quant) + r"[.-]", name, flags=re.IGNORECASE) is not None


# -- joining a split model ---------------------------------------------------------------------


def join_split(parts: list[Path], out: Path) -> None:
    """Write the parts of a split model as one GGUF file (what ``llama-gguf-split --merge``
    does): the first part's metadata without the ``split.*`` keys, every part's tensors with
    their offsets in the joined data, the bytes copied as they are. transformers reads one file,
    so the transformers engine de-quantizes a split model from this join."""
    headers = [read_header(p) for p in parts]
    first = headers[0]
    align = first.alignment
    kept = [(start, end) for key, start, end in first.kv_spans if not key.startswith("split.")]
    blocks: list[tuple[Path, int, int]] = []  # (file, start, length) of each tensor's bytes
    infos = bytearray()
    offset = 0
    for path, header in zip(parts, headers, strict=True):
        size = path.stat().st_size
        ordered = sorted(header.tensors, key=lambda t: t[1])
        for i, (info, start) in enumerate(ordered):
            end = ordered[i + 1][1] if i + 1 < len(ordered) else size - header.data_start
            infos += info + struct.pack("<Q", offset)
            blocks.append((path, header.data_start + start, end - start))
            offset += -(-(end - start) // align) * align
    with out.open("wb") as dst:
        dst.write(struct.pack("<4sIQQ", GGUF_MAGIC, first.version, len(blocks), len(kept)))
        with parts[0].open("rb") as src:
            for start, end in kept:
                src.seek(start)
                dst.write(src.read(end - start))
        dst.write(infos)
        _pad(dst, align)
        for path, start, length in blocks:
            with path.open("rb") as src:
                src.seek(start)
                _copy(src, dst, length)
            _pad(dst, align)


def _pad(handle: BinaryIO, align: int) -> None:
    handle.write(b"\x00" * (-handle.tell() % align))


def _copy(src: BinaryIO, dst: BinaryIO, length: int) -> None:
    remaining = length
    while remaining > 0:
        block = src.read(min(remaining, 1 << 24))
        if not block:
            raise GGUFFormatError(f"{src.name} ends before its tensor data does")
        dst.write(block)
        remaining -= len(block)

