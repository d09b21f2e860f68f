"""The llama.cpp member engine: one GGUF file loaded by llama.cpp as it is, one context whose
``n_seq_max`` sequences are the rows (:mod:`.slots`), answered with full log-softmax rows over
the tokenizer's ids."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from lm_eval_safe.engines.base import EngineBatch, MemberEngine
from lm_eval_safe.engines.llama_cpp.native import Model
from lm_eval_safe.engines.llama_cpp.slots import Slots


class LlamaCppEngine(MemberEngine):
    kind = "llama_cpp"
    full_rows = True

    def __init__(self, model: Model, batch_rows: bool, settings: dict[str, Any]):
        super().__init__()
        self.model = model
        self.slots = Slots(model, batch_rows)
        self.settings = settings

    # -- rows --------------------------------------------------------------------------
    def bind(self, member: Any) -> None:
        super().bind(member)
        #: the tokenizer's ids: a row holds these, whatever the width of the output layer (kept:
        #: a fast tokenizer counts them on every ``len``)
        self.vocab_size = len(member.tokenizer)

    def vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[k, n_vocab]`` logits as ``[k, tokenizer ids]``: output columns past the tokenizer
        (padded rows) dropped, tokenizer ids the output layer lacks at -inf (never a token)."""
        size = self.vocab_size
        width = logits.shape[-1]
        if width >= size:
            return logits[..., :size]
        pad = torch.full((*logits.shape[:-1], size - width), -math.inf, dtype=logits.dtype)
        return torch.cat([logits, pad], dim=-1)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.vocab_logits(logits), dim=-1)

    def argmax(self, logits: torch.Tensor) -> int:
        return int(torch.argmax(self.vocab_logits(logits)))

    @contextmanager
    def timed(self, rows: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.counters.calls += 1
            self.counters.seconds += time.perf_counter() - start

    # -- MemberEngine ------------------------------------------------------------------
    def new_batch(self) -> EngineBatch:
        from lm_eval_safe.engines.llama_cpp.batch import LlamaCppBatch

        return LlamaCppBatch(self)

    def score_tokens(
        self,
        pairs: Sequence[tuple[list[int], list[int]]],
        batch_size: int | str,
        max_batch_size: int,
        progress: Callable[[int], Any] | None = None,
    ) -> list[tuple[list[float], list[bool]]]:
        from lm_eval_safe.engines.llama_cpp.scoring import score_tokens

        return score_tokens(self, pairs, progress)

    @property
    def rolling_window(self) -> int:
        return self.member.max_length  # as HFLM: a window of max_length + 1 ids, the last not fed

    @property
    def sequence_limit(self) -> int:
        return self.member.max_length

    @property
    def shares_prefixes(self) -> bool:
        return True

    def prefill_counts(self) -> tuple[int, int]:
        return self.slots.looked_up, self.slots.reused

    def forget_prefixes(self) -> None:
        self.slots.forget()

    def describe(self) -> dict[str, Any]:
        return {"engine": self.kind, **self.settings}

    def identity(self) -> dict[str, Any]:
        """The engine (its kernels round differently from transformers': answers are kept
        apart in ``--use_cache``), the library's version and the settings that change logits
        (flash attention, layers on a GPU, the weights' layouts, how ids are cut into decodes)."""
        from importlib.metadata import version

        changing = {
            k: self.settings[k]
            for k in ("flash_attn", "n_gpu_layers", "use_extra_bufts", "n_batch", "batch_rows")
        }
        return {"engine": self.kind, "llama_cpp_python": version("llama-cpp-python"), **changing}
