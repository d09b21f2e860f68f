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
:mod:`.engine`, :mod:`.loading`, :mod:`.options` (llama.cpp's option names and their checks).
This module stays light: llama-cpp-python and torch are imported when a member loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval_safe.engines.llama_cpp.options import DEFAULTS, parse_option
from lm_eval_safe.engines.spec import EngineSpec, LoadedMember, MemberLoad
from lm_eval_safe.errors import OptionError

#: llama-cpp-python releases this engine is tested on (the ``llama-cpp`` extra's range)
TESTED = ("0.3.36", "0.4")


class LlamaCppSpec(EngineSpec):
    name = "llama_cpp"
    options = DEFAULTS

    def parse_option(self, key: str, value: Any) -> Any:
        return parse_option(key, value)

    def check_versions(self) -> None:
        from importlib.metadata import PackageNotFoundError, version

        from packaging.version import Version

        from lm_eval_safe.engines.llama_cpp.loading import INSTALL_HINT

        try:
            found = Version(version("llama-cpp-python"))
        except PackageNotFoundError:
            raise OptionError(INSTALL_HINT) from None
        low, high = (Version(v) for v in TESTED)
        if not low <= found < high:
            raise OptionError(
                f"engine=llama_cpp is tested on llama-cpp-python >={low},<{high}; found {found}: "
                f"pip install 'llama-cpp-python>={low},<{high}'"
            )

    def load(self, load: MemberLoad, **settings: Any) -> LoadedMember:
        from lm_eval_safe.engines.llama_cpp.loading import load_gguf

        return load_gguf(load, **settings)

    def generation_rows(self, members: Sequence[Any], jobs: Sequence[Any]) -> int:
        """As many rows as each member's context has sequences (``n_seq_max``)."""
        return min(len(m.engine.slots.busy) for m in members)

    def serving_rows(self, members: Sequence[Any]) -> int | None:
        return self.generation_rows(members, [])

    def thread_device(self, member: Any) -> Any:
        import torch

        return torch.device("cpu")  # llama.cpp's calls release the GIL: a thread of ours can run one


ENGINE = LlamaCppSpec()
