"""An engine that lives in the test tree, added through the registry's public call: the proof
that a third engine is one folder (here one module) and touches no package file.

It loads a member with transformers itself (its own loader, its own option key) and steps it
with the transformers engine's batches under its own name, so its greedy texts must be the
transformers engine's. Nothing in ``lm_eval_safe/`` knows :data:`NAME`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval_safe.engines.hf.engine import HFEngine
from lm_eval_safe.engines.spec import EngineSpec, LoadedMember, MemberLoad
from lm_eval_safe.errors import OptionError

NAME = "third"


class ThirdEngine(HFEngine):
    kind = NAME


class ThirdSpec(EngineSpec):
    name = NAME
    options = {"third_dtype": "float64"}  # a key this engine claims, with its default

    def parse_option(self, key: str, value: Any) -> Any:
        if value not in ("float32", "float64"):
            raise OptionError(f"{key}={value!r}: float32 or float64")
        return value

    def check_options(self, options: Any) -> None:
        if options.top_k > 50:
            raise OptionError("the third engine reads at most 50 ids")

    def member_settings(self, options: Any) -> dict[str, Any]:
        return {"precision": options.third_dtype}

    def load(self, load: MemberLoad, precision: str = "float64") -> LoadedMember:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lm_eval_safe.engines.hf.small_rows import SmallRowLinears

        dtype = getattr(torch, precision)
        location = load.source.location
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(location)
        small_rows = SmallRowLinears(model, "off", None, load.source.name)
        engine = ThirdEngine(model, None, small_rows, None, load.top_logprobs)
        return LoadedMember(tokenizer, model.config, model.generation_config, engine, "cpu", dtype)

    def generation_rows(self, members: Sequence[Any], jobs: Sequence[Any]) -> int:
        return 4

    def serving_rows(self, members: Sequence[Any]) -> int | None:
        return 3

    def thread_device(self, member: Any) -> Any:
        return member.engine.input_device


ENGINE = ThirdSpec()
