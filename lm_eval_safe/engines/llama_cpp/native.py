"""llama.cpp's low-level C API (through llama-cpp-python's ctypes bindings) in one place: a model
and its context, one ``llama_batch`` filled token by token with each token's position, sequence
id and logits flag, and the KV cache's per-sequence operations (remove a range, copy a prefix).

The high-level ``llama_cpp.Llama`` keeps one sequence and, with ``logits_all``, copies every
position's logits; this package asks for the logits of the positions it reads only, and keeps
one sequence per row.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lm_eval_safe.engines.llama_cpp.binding import set_fields
from lm_eval_safe.engines.llama_cpp.memory import check_kv_fits
from lm_eval_safe.engines.llama_cpp.options import check_sequences

logger = logging.getLogger(__name__)

#: ggml's log levels (``enum ggml_log_level`` of ggml.h): a ``CONT`` piece continues the line
#: before it
DEBUG, INFO, WARN, ERROR, CONT = 1, 2, 3, 4, 5


class Log:
    """llama.cpp's log, kept instead of printed (it writes every tensor of every load): its last
    warning and error lines, for this engine's error messages, and every line to this module's
    logger at DEBUG (``logging.getLogger("lm_eval_safe.engines.llama_cpp.native")``)."""

    def __init__(self, keep: int = 32):
        self._kept: deque[tuple[int, int, str]] = deque(maxlen=keep)  # (number, level, line)
        self._number = 0
        self._level = INFO
        self._partial = ""
        self._lock = threading.Lock()

    def __call__(self, level: int, text: bytes | None, user_data: Any) -> None:
        piece = text.decode("utf-8", errors="replace") if text else ""
        with self._lock:
            if level != CONT:
                self._level = level
            self._partial += piece
            while "\n" in self._partial:
                line, self._partial = self._partial.split("\n", 1)
                self._line(self._level, line.strip())

    def _line(self, level: int, line: str) -> None:
        if not line:
            return
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("llama.cpp: %s", line)
        if level in (WARN, ERROR):
            self._number += 1
            self._kept.append((self._number, level, line))

    def mark(self) -> int:
        """A point in the log: :meth:`words` reads what came after it."""
        with self._lock:
            return self._number

    def words(self, since: int, most: int = 3) -> str:
        """What llama.cpp logged after ``since`` (:meth:`mark`), as one line: its last ``most``
        error lines, or its warnings where it wrote no error ('' where it wrote neither)."""
        with self._lock:
            if self._partial.strip():  # a last piece without its line end
                self._line(self._level, self._partial.strip())
                self._partial = ""
            recent = [(level, line) for number, level, line in self._kept if number > since]
        errors = [line for level, line in recent if level == ERROR]
        return "; ".join((errors or [line for _, line in recent])[-most:])


#: the one log of this process (llama.cpp has one log callback per process)
LOG = Log()
_BACKEND_READY = False
_LOG_CALLBACK: Any = None


def backend() -> Any:
    """The ``llama_cpp`` module, its backend initialised once per process, its log kept by
    :data:`LOG` instead of printed."""
    global _BACKEND_READY, _LOG_CALLBACK
    import llama_cpp

    if not _BACKEND_READY:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(LOG)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _BACKEND_READY = True
    return llama_cpp


@dataclass(frozen=True)
class ContextSettings:
    """What a model and its context are made with (llama.cpp's names). ``n_ctx``: ids of each
    sequence (each has a stream of its own, of ``n_ctx`` cells padded to a multiple of 256)."""

    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_threads: int
    flash_attn: str  # "auto" | "on" | "off"
    use_extra_bufts: bool = False


#: what each ``llama_decode`` return code means (llama.h); other negative codes: a failure
DECODE_CODES = {
    1: "no KV slot for the batch",
    2: "aborted",
    -1: "an invalid batch",
}


class DecodeError(RuntimeError):
    """``llama_decode`` refused a batch: ``code`` as llama.h names it (1: no KV slot for the
    batch; 2: aborted; -1: an invalid batch; below -1: a failure), and what llama.cpp logged."""

    def __init__(self, code: int, words: str = ""):
        self.code = code
        self.meaning = DECODE_CODES.get(code, "a failure inside llama.cpp")
        self.words = words
        said = f": {words}" if words else ""
        super().__init__(f"llama_decode returned {code} ({self.meaning}){said}")


def _context_hint(words: str) -> str:
    """What to change after a failed context: its memory where llama.cpp ran out of it."""
    if any(w in words.lower() for w in ("alloc", "memory")):
        return "give a smaller n_ctx= or n_seq_max= (the KV cache holds n_seq_max x n_ctx cells)"
    return "change what llama.cpp's words name among n_ctx=, n_batch=, n_seq_max=, flash_attn= and n_gpu_layers="


class Model:
    """A GGUF file loaded by llama.cpp as it is (no conversion), and one context over it whose
    sequences each have a KV stream of their own (``kv_unified`` off, ``n_ctx`` cells each).

    Streams of their own: in a unified cache a sequence's next ids take the first free cells,
    which may lie below its earlier ones (a hole another sequence's rollback left), and the CPU
    flash-attention kernel sums a position's attention in the order of the cells (in f16), so
    the same ids get other logits (SmolLM2: up to 1.06). In a stream of its own a sequence's
    cells follow its positions whatever other rows did, bit-identical to a fresh context."""

    def __init__(self, path: str, n_gpu_layers: int, settings: ContextSettings):
        check_sequences(settings.n_seq_max, settings.n_batch)
        check_kv_fits(path, settings.n_ctx, settings.n_seq_max, n_gpu_layers)
        lib = backend()
        self.lib = lib
        params = lib.llama_model_default_params()
        # repacked weight layouts compute rows in groups of 4 and the rest apart, so a
        # position's logits would depend on how many ids share its decode (Gemma-3: by 3.6)
        set_fields(params, n_gpu_layers=n_gpu_layers, use_extra_bufts=settings.use_extra_bufts)
        mark = LOG.mark()
        model = lib.llama_model_load_from_file(path.encode(), params)
        if not model:
            words = LOG.words(mark) or "it logged no error"
            raise OSError(
                f"llama.cpp could not load {path} ({words}): check the file (download it again) "
                "and that this llama.cpp knows its architecture"
            )
        self.model = model
        self.vocab = lib.llama_model_get_vocab(model)
        #: the width of every logits row (the model's output layer; may differ from the tokenizer)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.settings = settings
        ctx_params = lib.llama_context_default_params()
        set_fields(
            ctx_params,
            n_ctx=settings.n_ctx * settings.n_seq_max,
            n_batch=settings.n_batch,
            n_ubatch=settings.n_batch,
            n_seq_max=settings.n_seq_max,
            n_threads=settings.n_threads,
            n_threads_batch=settings.n_threads,
            flash_attn_type={
                "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
                "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
            }[settings.flash_attn],
            kv_unified=False,
            # sliding-window layers keep every position, so a rollback to any earlier position
            # is possible (a window-sized cache forgets what a rejected draft would return to)
            swa_full=True,
            no_perf=True,
        )
        mark = LOG.mark()
        ctx = lib.llama_init_from_model(model, ctx_params)
        if not ctx:
            lib.llama_model_free(model)
            self.model = None
            words = LOG.words(mark) or "it logged no error"
            raise OSError(
                f"llama.cpp could not make a context of {settings.n_seq_max} sequences of "
                f"{settings.n_ctx} ids for {path} ({words}): {_context_hint(words)}"
            )
        self.ctx = ctx
        self.memory = lib.llama_get_memory(ctx)
        #: ids of each sequence, as configured (what ``max_length`` is capped at)
        self.n_ctx = settings.n_ctx
        #: KV cells each sequence has: ``n_ctx`` padded by llama.cpp (:mod:`.memory`), read back
        self.cells_per_sequence = int(lib.llama_n_ctx_seq(ctx))
        self.n_batch = int(lib.llama_n_batch(ctx))
        # read back what the context was made with: a decode of a block must be one micro-batch
        # (the rows' exactness), and every row needs its sequence
        made = {"n_ubatch": int(lib.llama_n_ubatch(ctx)), "n_seq_max": int(lib.llama_n_seq_max(ctx))}
        wanted = {"n_ubatch": self.n_batch, "n_seq_max": settings.n_seq_max}
        if made != wanted:
            self.close()
            raise OSError(
                f"llama.cpp made the context of {path} with {made} where this engine set {wanted}: "
                "this llama-cpp-python does not keep the settings rows need to be exact"
            )
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)

    # -- KV cache ------------------------------------------------------------------------
    def remove(self, seq: int, start: int) -> None:
        """Forget sequence ``seq`` from position ``start`` on (``0``: all of it)."""
        self.lib.llama_memory_seq_rm(self.memory, seq, start, -1)

    def copy(self, source: int, target: int, length: int) -> None:
        """Sequence ``target`` holds the first ``length`` positions of ``source`` (the cells
        are shared, not recomputed)."""
        lib = self.lib
        lib.llama_memory_seq_rm(self.memory, target, 0, -1)
        if not length:
            return
        # across streams llama.cpp copies a whole stream (its cells, in their order)
        lib.llama_memory_seq_cp(self.memory, source, target, -1, -1)
        lib.llama_memory_seq_rm(self.memory, target, length, -1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    # -- decoding ------------------------------------------------------------------------
    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """Feed ``(token, position, seq_id, wants_logits)`` entries (in ``n_batch`` chunks) and
        return the logits of the flagged entries, in order, as a ``[k, n_vocab]`` float32
        tensor (copied out of llama.cpp's buffer, which the next decode overwrites)."""
        lib, batch = self.lib, self._batch
        out: list[torch.Tensor] = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            flagged = []
            for i, (token, pos, seq, wants) in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if wants else 0
                if wants:
                    flagged.append(i)
            batch.n_tokens = len(chunk)
            mark = LOG.mark()
            code = int(lib.llama_decode(self.ctx, batch))
            if code != 0:
                raise DecodeError(code, LOG.words(mark))
            for i in flagged:
                pointer = lib.llama_get_logits_ith(self.ctx, i)
                row = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
                out.append(torch.from_numpy(row.copy()))
        if not out:
            return torch.empty((0, self.n_vocab), dtype=torch.float32)
        return torch.stack(out)

    def close(self) -> None:
        lib = self.lib
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        # at interpreter shutdown the modules this needs may already be gone (even contextlib)
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass
