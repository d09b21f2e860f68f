"""The llama.cpp engine (``engine=llama_cpp``): GGUF members on llama.cpp's own kernels, through
llama-cpp-python's low-level API, the file loaded as it is (no de-quantized copy).

- every row of a generation batch is a sequence (``seq_id``) of the member's one context, kept
  across calls: a rejected draft is rolled back with ``llama_memory_seq_rm``, a prompt prefix
  another sequence holds is copied with ``llama_memory_seq_cp`` (:mod:`.slots`);
- a verifier's window asks for logits at the positions it reads only (per-token logits flags
  in one ``llama_batch``); a draft step feeds one id per drafting row;
- rows are full log-softmax rows over the tokenizer's ids, so every decision is exact;
- each row's ids are decoded apart from other rows', cut at the multiples of ``n_batch``, so a row
  gets the distributions it gets alone (:mod:`.slots`).

Modules: :mod:`.native` (the C API in one place), :mod:`.slots`, :mod:`.batch`, :mod:`.scoring`,
:mod:`.engine`, :mod:`.loading`, :mod:`.options` (llama.cpp's option names and their checks),
:mod:`.binding` (the tested llama-cpp-python releases and the fields the exactness rests on),
:mod:`.memory` (the KV cache's bytes from the GGUF header, refused before loading past memory).
This module stays light: llama-cpp-python and torch are imported when a member loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval_safe.engines.llama_cpp.options import DEFAULTS, check_sequences, parse_option
from lm_eval_safe.engines.spec import EngineSpec, LoadedMember, MemberLoad
from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.sources import MemberSource


class LlamaCppSpec(EngineSpec):
    name = "llama_cpp"
    options = DEFAULTS

    def parse_option(self, key: str, value: Any) -> Any:
        return parse_option(key, value)

    def check_options(self, options: Any) -> None:
        """A row holds one of a member's ``n_seq_max`` sequences from its first id to its last,
        so a batch of more rows would fail in the middle of a run: refused here, as are more
        sequences than ``n_batch`` (:func:`.options.check_sequences`)."""
        check_sequences(options.n_seq_max, options.n_batch)
        rows = options.batch_size
        if rows != "auto" and int(rows) > options.n_seq_max:
            raise OptionError(
                f"batch_size={rows} is more rows than llama.cpp's n_seq_max={options.n_seq_max} "
                f"sequences (one a row): give n_seq_max={rows}, or batch_size={options.n_seq_max} or auto"
            )

    def check_versions(self) -> None:
        from lm_eval_safe.engines.llama_cpp.binding import check_binding

        check_binding()

    def check_source(self, source: MemberSource) -> None:
        if source.kind != "gguf":
            raise OptionError(
                f"member {source.spec!r} is a {source.kind} checkpoint: engine=llama_cpp loads GGUF "
                "files (an alias, a .gguf file, or a GGUF model of Ollama, LM Studio or the Hugging "
                "Face cache: `lm-eval-safe models`); put it on another engine with engines="
            )

    def load(self, load: MemberLoad, **settings: Any) -> LoadedMember:
        from lm_eval_safe.engines.llama_cpp.loading import load_gguf

        return load_gguf(load, **settings)

    def generation_rows(self, members: Sequence[Any], jobs: Sequence[Any]) -> int:
        """As many rows as each member's context has sequences (``n_seq_max``)."""
        return min(len(m.engine.slots.busy) for m in members)

    def serving_rows(self, members: Sequence[Any]) -> int | None:
        """One sequence fewer than each member holds: a request's scoring (``echo`` with
        ``logprobs``) runs between two decoding cycles and takes a sequence of its own, which
        rows holding every one would starve."""
        held = self.generation_rows(members, [])
        if held < 2:
            raise OptionError(
                "the server scores requests on a llama.cpp sequence of its own beside the rows: "
                "give n_seq_max=2 or more"
            )
        return held - 1

    def thread_device(self, member: Any) -> Any:
        import torch

        return torch.device("cpu")  # llama.cpp's calls release the GIL: a thread of ours can run one


ENGINE = LlamaCppSpec()
