"""The transformers engine (``engine=hf``, the default): members stepped by this project's own
batches in this process (the embedded default, and the one every other engine is checked
against).

It computes full log-softmax rows over the tokenizer's ids and keeps them on the member's
device; the decoder gets each position's head (:mod:`.heads`: one device-to-host copy per batch
step) and the full rows of the positions a head cannot decide (``Complete``), so every
decision is the exact one. Modules: :mod:`.engine` (the member's engine), :mod:`.loading`
(model, device, dtype), :mod:`.batch` (one KV cache per member shared by a batch, per-row
rollback), :mod:`.forward` and :mod:`.kv_cache` (transformers' internals, in one place),
:mod:`.prefix_cache` (prompt prefixes shared across requests), :mod:`.small_rows` (CPU linears
over few rows), :mod:`.scoring` (batched continuation scores), :mod:`.instruments` and
:mod:`.clocks` (what the benchmarks hook or time inside a model).

This module is the engine's :class:`~lm_eval_safe.engines.spec.EngineSpec` and stays light:
torch and transformers are imported when a member loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval_safe.engines.spec import EngineSpec, Instruments, LoadedMember, MemberLoad
from lm_eval_safe.errors import OptionError
from lm_eval_safe.model_args import as_number, choice

#: ``fast_small_linear=``: CPU linears over few rows (:mod:`.small_rows`)
FAST_SMALL_LINEAR = ("auto", "on", "off")


class TransformersSpec(EngineSpec):
    name = "hf"
    options = {"fast_small_linear": "auto", "prefix_cache_mb": 256.0}

    def parse_option(self, key: str, value: Any) -> Any:
        if key == "fast_small_linear":
            return choice(value, key, FAST_SMALL_LINEAR)
        budget = as_number(value, key, float)
        if budget < 0:
            raise OptionError(f"prefix_cache_mb={budget} must be >= 0 (0 turns prefix reuse off)")
        return budget

    def load(self, load: MemberLoad, **settings: Any) -> LoadedMember:
        from lm_eval_safe.engines.hf.loading import load_hf_member

        return load_hf_member(load, **settings)

    def generation_rows(self, members: Sequence[Any], jobs: Sequence[Any]) -> int:
        from lm_eval_safe.engines.hf.batch import auto_generation_rows

        return auto_generation_rows(list(members), list(jobs))

    def instruments(self) -> Instruments:
        from lm_eval_safe.engines.hf import instruments

        return instruments  # a module: it has every name of the protocol

    def thread_device(self, member: Any) -> Any:
        return member.engine.input_device


ENGINE = TransformersSpec()
