"""Where an engine loads a member's checkpoint from: a GGUF file de-quantized once by
transformers into a safetensors folder under the cache (15-45 s on a laptop CPU the first time,
seconds after), else the member's folder or hub id as it is; and transformers' own loading of a
checkpoint, which the conversion and the transformers engine share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from lm_eval_safe.disk_cache import cache_root, cached_folder
from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.gguf_info import join_split, split_parts
from lm_eval_safe.members.sources import MemberSource, check_gguf_file

logger = logging.getLogger(__name__)


#: Part of every converted-weights folder name; bump when the folder's layout changes, so that
#: entries of another layout (or another version of this package sharing the cache) are never
#: read as this one's. 2: manifest.json with checksums (lm_eval_safe.disk_cache); 4: the
#: safetensors metadata says its format and tied weights are stored under the input
#: embedding's name (transformers 4.57 refuses or half-loads the file otherwise); 5: config.json
#: names the model class in ``architectures`` (vLLM picks its implementation from it, and without
#: it loads Gemma-3 as an embedding model).
CONVERTED_FORMAT = 5


def _converted_folder(source: MemberSource, dtype_name: str, root: Path) -> Path:
    """One folder per GGUF content (its sha256: an alias, a path and a store's name of one file
    share it; a source made without ``resolve_source``: its path, size and mtime), dtype and
    transformers version: the config and tokenizer files are written by the installed
    transformers, and another release may read them differently (transformers 5 rewrote how rope
    settings and tokenizers are saved), so a conversion is never shared across versions."""
    import transformers

    if source.sha256:  # by its content, whichever alias, name or path reached it
        identity = f"sha256={','.join(source.sha256)}|format={CONVERTED_FORMAT}"
        stem = f"sha256-{source.sha256[0][:16]}"
    else:
        stat = Path(source.location).stat()
        identity = f"{source.location}|{stat.st_size}|{stat.st_mtime_ns}|format={CONVERTED_FORMAT}"
        stem = Path(source.location).stem
    identity += f"|transformers={transformers.__version__}"
    key = hashlib.sha1(identity.encode()).hexdigest()[:12]
    return root / "converted" / f"{stem}-{dtype_name}-{key}"


def _load_gguf(source: MemberSource, dtype: Any, trust_remote_code: bool) -> tuple[Any, Any]:
    """De-quantize a GGUF file with transformers; a file it cannot read names the member."""
    check_gguf_file(source)
    gguf = Path(source.location)
    start = time.perf_counter()
    try:
        model, tokenizer = load_pretrained(
            str(gguf.parent), dtype, trust_remote_code, gguf_file=gguf.name
        )
    except (ValueError, OSError, KeyError, IndexError, EOFError, struct.error) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise OptionError(
            f"member {source.spec!r}: transformers could not read the GGUF file {gguf} ({first}); "
            "if it is truncated or damaged, download it again"
        ) from exc
    logger.info("de-quantized %s in %.1fs", gguf.name, time.perf_counter() - start)
    return model, tokenizer


@contextmanager
def _whole_file(source: MemberSource, scratch: Path) -> Iterator[MemberSource]:
    """``source`` as one GGUF file: a split model (``-00001-of-0000N.gguf``) joined under
    ``scratch`` for as long as transformers reads it (transformers reads one file; llama.cpp
    loads the parts as they are)."""
    parts = split_parts(Path(source.location))
    if len(parts) == 1:
        yield source
        return
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise OptionError(
            f"member {source.spec!r}: {parts[0].name} is split in {len(parts)} files and "
            f"{', '.join(missing)} is missing beside it; download the model again"
        )
    joined = scratch / parts[0].name.replace("-00001-of-", "-joined-of-")
    logger.info("joining the %d parts of %s for transformers", len(parts), source.name)
    join_split(parts, joined)
    try:
        yield replace(source, location=str(joined))
    finally:
        joined.unlink(missing_ok=True)


def load_pretrained(
    location: str, dtype: Any, trust_remote_code: bool, device_map: str | None = None, **kwargs: Any
) -> tuple[Any, Any]:
    """transformers' model and tokenizer of a checkpoint (also how a GGUF is de-quantized)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        location, trust_remote_code=trust_remote_code, **kwargs
    )
    placement = {} if device_map is None else {"device_map": device_map}
    model = AutoModelForCausalLM.from_pretrained(
        location, dtype=dtype, trust_remote_code=trust_remote_code, **placement, **kwargs
    )
    return model, tokenizer


def _save_dequantized(model: Any, tokenizer: Any, folder: Path) -> None:
    """Save de-quantized weights as a plain checkpoint.

    transformers refuses ``save_pretrained`` on a model loaded from GGUF (it still carries the
    GGUF quantizer), although its weights are ordinary tensors by now: write them directly.
    """
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    # a model de-quantized from GGUF has no architectures; engines other than transformers (vLLM)
    # choose their model implementation from it
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    _save_weights(model, folder / "model.safetensors")
    tokenizer.save_pretrained(folder)


def _save_weights(model: Any, path: Path) -> None:
    """Every tensor once, under the name ``from_pretrained`` expects: a tensor shared by several
    names (tied input and output embeddings) is written under the input embedding's name, the
    one transformers 4.57 and 5.x both tie the others to (``safetensors.save_model`` may keep
    ``lm_head.weight`` instead, which 4.57 then leaves unloaded). The metadata says the format:
    4.57 refuses a file without it."""
    from safetensors.torch import save_file

    state = model.state_dict()
    embedding = model.get_input_embeddings().weight
    first = [k for k, t in state.items() if t is embedding]
    kept: dict[tuple[int, tuple[int, ...]], str] = {}
    tensors = {}
    for key in first + [k for k in state if k not in first]:
        tensor = state[key]
        owner = (tensor.data_ptr(), tuple(tensor.shape))
        if owner in kept:
            continue  # the same weights under another name: tied when loaded
        kept[owner] = key
        tensors[key] = tensor.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def checkpoint_folder(
    source: MemberSource, dtype: Any, trust_remote_code: bool, cache_dir: str | None
) -> str:
    """Where an engine loads the member from: a GGUF's converted folder (written once, on
    first use), else the folder or hub id itself. Every engine loads GGUF members from the
    converted folder: transformers then reads it as any checkpoint, and vLLM has no GGUF loader
    for these architectures."""
    if source.kind != "gguf":
        return source.location
    if find_spec("gguf") is None:
        raise OptionError(
            f"member {source.spec!r} is a GGUF file: install the gguf package (pip install gguf)"
        )
    dtype_name = str(dtype).replace("torch.", "")
    folder = _converted_folder(source, dtype_name, cache_root(cache_dir))

    def convert(tmp: Path) -> None:
        with _whole_file(source, tmp) as whole:
            model, tokenizer = _load_gguf(whole, dtype, trust_remote_code)
        logger.info("caching the de-quantized weights of %s in %s", source.name, folder)
        _save_dequantized(model, tokenizer, tmp)
        (tmp / "complete.json").write_text(json.dumps(source.describe()))

    cached_folder(folder, convert, f"converted weights of member {source.name!r}")
    return str(folder)
