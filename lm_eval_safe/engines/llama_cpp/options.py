"""The llama.cpp engine's options, in llama.cpp's own names, and their checks."""

from __future__ import annotations

import os
from typing import Any

from lm_eval_safe.errors import OptionError

#: ``--model_args`` keys of this engine and their defaults. ``n_threads`` 0: every core this
#: process may use; ``n_ctx``: KV cells of each sequence; ``n_batch``: most ids one
#: ``llama_decode`` takes, and the blocks every feed is cut into; ``n_seq_max``: sequences (rows
#: of a batch, and prompt prefixes kept for reuse); ``n_gpu_layers``: layers on a GPU or Metal
#: (0: none; -1: all); ``use_extra_bufts``: llama.cpp's repacked CPU weight layouts (faster by a
#: few percent, but a position's logits then depend on how many ids share its decode);
#: ``batch_rows``: a batch's rows in one ``llama_decode`` (faster at several rows, but a row's
#: text then depends on its batch).
DEFAULTS: dict[str, Any] = {
    "n_threads": 0,
    "n_ctx": 4096,
    "n_batch": 128,
    "n_seq_max": 8,
    "n_gpu_layers": 0,
    "flash_attn": "auto",
    "use_extra_bufts": False,
    "batch_rows": False,
}
FLASH_ATTN = ("auto", "on", "off")


def _integer(key: str, value: Any, low: int) -> int:
    if isinstance(value, bool):
        raise OptionError(f"{key}={value!r} must be a whole number")
    try:
        number = int(str(value).strip())
    except ValueError:
        raise OptionError(f"{key}={value!r} must be a whole number") from None
    if number < low:
        raise OptionError(f"{key}={number} must be at least {low}")
    return number


def _switch(key: str, value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "on", "yes"):
        return True
    if text in ("false", "0", "off", "no"):
        return False
    raise OptionError(f"{key}={value!r}: give true or false")


def parse_option(key: str, value: Any) -> Any:
    """One option's value, typed and checked (one-line :class:`OptionError`)."""
    if key in ("use_extra_bufts", "batch_rows"):
        return _switch(key, value)
    if key == "flash_attn":
        text = str(value).strip().lower()
        text = {"true": "on", "false": "off", "1": "on", "0": "off"}.get(text, text)
        if text not in FLASH_ATTN:
            raise OptionError(f"flash_attn={value!r}: give one of {', '.join(FLASH_ATTN)}")
        return text
    if key == "n_gpu_layers":
        return _integer(key, value, -1)
    if key == "n_threads":
        return _integer(key, value, 0)
    if key == "n_ctx":
        return _integer(key, value, 16)
    if key == "n_batch":
        return _integer(key, value, 1)
    if key == "n_seq_max":
        number = _integer(key, value, 1)
        if number > 256:
            raise OptionError(f"n_seq_max={number}: llama.cpp holds at most 256 sequences")
        return number
    raise OptionError(f"unknown llama.cpp option {key}=")


def threads(n_threads: int) -> int:
    """``n_threads`` 0: the cores this process may run on."""
    if n_threads > 0:
        return n_threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def check_sequences(n_seq_max: int, n_batch: int) -> None:
    """Making a context, llama.cpp asserts that its ``n_seq_max`` sequences fit in the output
    rows it reserves for ``n_batch`` ids (``GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)``
    with n_batch=128 and n_seq_max=129), and a failed assertion aborts the whole process, with no
    error a caller could catch: such settings are refused before any member loads."""
    if n_seq_max > n_batch:
        raise OptionError(
            f"n_seq_max={n_seq_max} is more sequences than n_batch={n_batch}: llama.cpp aborts the "
            f"process making such a context; give n_batch={n_seq_max} or more, or n_seq_max={n_batch} or fewer"
        )
