"""An engine claiming a key another engine already claims (llama.cpp's ``n_ctx``): registering
it is refused (tests/engines/test_engine_registry.py)."""

from __future__ import annotations

from lm_eval_safe.engines.spec import EngineSpec


class FourthSpec(EngineSpec):
    name = "fourth"
    options = {"n_ctx": 512}


ENGINE = FourthSpec()
