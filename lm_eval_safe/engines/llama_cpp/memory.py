"""The memory a member's llama.cpp KV cache takes, computed from its GGUF header before anything
is allocated, and the refusal of an ``n_ctx`` whose cache this machine cannot hold.

Why before: llama.cpp allocates the whole cache when the context is made (``n_seq_max``
streams of ``n_ctx`` cells, every layer's keys and values), and a cache larger than the memory
fails inside it, after the weights have loaded, or is granted by the kernel and then swaps or
gets the process killed. The size follows from the header alone, as llama.cpp computes it:

- each sequence has a stream of its own (``kv_unified`` off) of ``n_ctx`` cells rounded up to a
  multiple of 256 (llama.cpp pads each stream so; ``llama_n_ctx_seq`` reads it back);
- every layer holds that many cells (sliding-window layers too: the engine sets ``swa_full``),
  each ``n_head_kv x (key_length + value_length)`` values of the cache's type, f16 (2 bytes: the
  type llama.cpp's defaults give, which this engine keeps).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.gguf_info import GGUFFormatError, GGUFHeader, read_header

logger = logging.getLogger(__name__)

#: llama.cpp pads each sequence's stream to a multiple of this many cells
CELL_PADDING = 256
#: bytes of one cached value: f16, llama.cpp's default ``type_k``/``type_v``, which the engine keeps
KV_VALUE_BYTES = 2
#: header keys of caches of another shape (compressed latent attention, recurrent state),
#: whose size this arithmetic does not give: llama.cpp is left to decide for them
_OTHER_CACHES = (".attention.kv_lora_rank", ".ssm.", ".wkv.", ".shortconv.")


def cells_per_sequence(n_ctx: int) -> int:
    """The KV cells llama.cpp gives each sequence for this engine's ``n_ctx`` (its streams are
    padded to a multiple of :data:`CELL_PADDING`)."""
    return -(-n_ctx // CELL_PADDING) * CELL_PADDING


@dataclass(frozen=True)
class KVShape:
    """What one cell of a model's KV cache holds, from its GGUF header."""

    layers: int  # layers that keep a cache of their own
    values_per_layer: int  # n_head_kv x (key_length + value_length)

    def bytes(self, n_ctx: int, n_seq_max: int) -> int:
        """The KV cache's bytes for ``n_seq_max`` sequences of ``n_ctx`` ids each."""
        return cells_per_sequence(n_ctx) * n_seq_max * self.layers * self.values_per_layer * KV_VALUE_BYTES


def kv_shape(header: GGUFHeader) -> KVShape | None:
    """The KV cache's shape as llama.cpp reads it from the header (a key it lacks takes
    llama.cpp's default: ``head_count_kv`` the head count, key and value lengths the embedding
    width over the head count); None for a cache of another shape, or per-layer head counts."""
    arch = header.architecture
    values = header.values
    if arch is None or any(part in key for key in [*values, *header.array_lengths] for part in _OTHER_CACHES):
        return None
    layers, width, heads = (values.get(f"{arch}.{k}") for k in ("block_count", "embedding_length", "attention.head_count"))
    heads_kv = values.get(f"{arch}.attention.head_count_kv", heads)
    if not all(isinstance(v, int) and v > 0 for v in (layers, width, heads, heads_kv)):
        return None  # per-layer arrays (read as lengths only) or a header without them
    key = values.get(f"{arch}.attention.key_length", width // heads)
    value = values.get(f"{arch}.attention.value_length", width // heads)
    shared = values.get(f"{arch}.attention.shared_kv_layers", 0)  # layers reading another's cache
    return KVShape(layers - int(shared), heads_kv * (key + value))


def available_memory() -> int | None:
    """Bytes this machine can give now without swapping: Linux's ``MemAvailable``, else the
    physical memory (where ``/proc/meminfo`` is missing); None where neither can be read."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_kv_fits(path: str, n_ctx: int, n_seq_max: int, n_gpu_layers: int) -> None:
    """Refuse, in one line with the bytes it needs, an ``n_ctx`` whose KV cache does not fit in
    this machine's available memory, before the weights load. Only where the cache lies in this
    machine's memory (``n_gpu_layers=0``): a GPU's memory is llama.cpp's to refuse."""
    if n_gpu_layers != 0:
        return
    try:
        shape = kv_shape(read_header(Path(path)))
    except (OSError, GGUFFormatError):
        return  # a file llama.cpp cannot load either: its load says why, in its own words
    available = available_memory()
    if shape is None or available is None:
        logger.debug("no KV cache estimate for %s: llama.cpp decides whether it fits", path)
        return
    needed = shape.bytes(n_ctx, n_seq_max)
    if needed > available:
        cells = cells_per_sequence(n_ctx)
        raise OptionError(
            f"n_ctx={n_ctx} with n_seq_max={n_seq_max}: llama.cpp's KV cache of {Path(path).name} "
            f"would take {needed} bytes ({needed / 2**30:.1f} GiB: {n_seq_max} sequences of {cells} "
            f"cells, {shape.layers} layers, f16) and this machine has {available} bytes "
            f"({available / 2**30:.1f} GiB) available: give a smaller n_ctx= or n_seq_max="
        )
