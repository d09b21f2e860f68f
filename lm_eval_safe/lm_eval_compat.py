"""What differs between the lm-eval releases this package supports, where a backend must mirror
lm-eval rather than choose for itself.

Two generations (``lm_eval_safe.versions`` holds the tested range):

- **0.4.9.x**: a dict ``MODEL_REGISTRY`` of classes, an argparse CLI that hands
  ``--model_args`` to the model as typed, no ``normalize_gen_kwargs``, and an ``hf`` backend that
  encodes a causal LM's texts *without* special tokens unless ``add_bos_token=True`` or the
  model type is a Gemma.
- **0.4.10+**: a lazy ``model_registry``, the ``lm_eval._cli`` package (whose parser rejects
  ``members=a,b`` until the start-up hook patches it), and an ``hf`` backend that leaves special
  tokens to the tokenizer's default, except for a text that already starts with the BOS string.

The registry and CLI differences are handled by the start-up hook (``_autoregister``), which must
stay import-light; the generation kwargs rule is written out in ``sampling``. This module holds
the encoding rule, so that a member alone scores and generates exactly as lm-eval's own ``hf``
backend does under whichever lm-eval is installed.
"""

from __future__ import annotations

from functools import cache

from packaging.version import Version

from lm_eval_safe.versions import installed

#: The first lm-eval release of the second generation.
SECOND_GENERATION = Version("0.4.10")


@cache
def first_generation() -> bool:
    """lm-eval 0.4.9.x is installed."""
    return installed("lm-eval") < SECOND_GENERATION


def bos_rule() -> str:
    """How ``add_bos_token`` unset is read: ``"tokenizer"`` (its own default, 0.4.10+) or
    ``"gemma-only"`` (no special tokens but for Gemma models, 0.4.9)."""
    return "gemma-only" if first_generation() else "tokenizer"


def default_add_special_tokens(model_type: str) -> bool | None:
    """``add_special_tokens`` for a text when ``add_bos_token`` is not given, as lm-eval's
    ``hf`` backend encodes it (None: the tokenizer's own default)."""
    if first_generation():
        return "gemma" in model_type
    return None
