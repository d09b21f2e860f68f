"""Running a transformers model with a cache: the forward's cache keyword, the decoder body, the
output head, the config fields they read, and attention masks built from real positions (one of
the three modules that know transformers' internals, with :mod:`.kv_cache` and
:mod:`.packed_slots`).

The forward's cache keyword: transformers 5.x renamed ``past_key_values`` to ``cache`` (the
old name is deprecated); 4.57, and models shipping their own code (``trust_remote_code``) on
any version, take ``past_key_values``. A keyword a forward does not declare is swallowed by its
``**kwargs`` and the model runs *without* the cache, wrong by up to 20 nats and with no error
(what transformers 4.57 did with ``cache=``), so the keyword is read from each model class's
signature, and a forward that declares neither name is refused.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

from lm_eval_safe.engines.hf.kv_cache import UnsupportedModelError

_CACHE_KEYWORDS: dict[type, str] = {}


def cache_keyword(module: Any) -> str:
    """The keyword under which ``module.forward`` takes a cache (see the module docstring),
    read once per class from its signature."""
    cls = type(module)
    keyword = _CACHE_KEYWORDS.get(cls)
    if keyword is None:
        parameters = inspect.signature(cls.forward).parameters
        if "cache" in parameters:
            keyword = "cache"
        elif "past_key_values" in parameters:
            keyword = "past_key_values"
        else:
            raise UnsupportedModelError(
                f"{cls.__name__}.forward takes neither cache= nor past_key_values=; "
                "lm-eval-safe cannot keep its KV cache"
            )
        _CACHE_KEYWORDS[cls] = keyword
    return keyword


def run(module: Any, cache: Any | None, **inputs: Any) -> Any:
    """``module(**inputs)`` with ``cache`` under the keyword its forward declares (None: no
    cache is kept)."""
    if cache is None:
        return module(use_cache=False, **inputs)
    return module(use_cache=True, **{cache_keyword(module): cache}, **inputs)


def decoder(model: Any) -> Any:
    """The model without its output head (the module returning ``last_hidden_state``).

    ``model.base_model`` is that module for most architectures, but in transformers 4.57
    Gemma-3's causal LM names a ``base_model_prefix`` it does not have, so ``base_model`` is the
    whole model; ``get_decoder()`` finds the body in 4.57 and 5.x alike."""
    body = model.get_decoder()
    if body is model:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no separate decoder body: use batch_size=1"
        )
    return body


def text_config(model: Any) -> Any:
    """The decoder's config (a multimodal config nests it as ``text_config``)."""
    return model.config.get_text_config()


_CONFIG_FIELDS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def config_field(model: Any, name: str) -> Any:
    """A field of the decoder config that only some architectures define (``sliding_window``,
    ``layer_types``, ``final_logit_softcapping``, ``head_dim``...): None where this
    architecture's config has no such field, which is what its own modeling code then reads.
    The config is read as data (``to_dict``, once per model), not probed for attributes."""
    fields = _CONFIG_FIELDS.get(model)
    if fields is None:
        fields = _CONFIG_FIELDS[model] = text_config(model).to_dict()
    return fields.get(name)


def kv_bytes_per_token(model: Any) -> int:
    """KV-cache bytes one token costs (keys and values, every layer)."""
    config = text_config(model)
    heads = config_field(model, "num_key_value_heads") or config.num_attention_heads
    head_dim = config_field(model, "head_dim") or config.hidden_size // config.num_attention_heads
    element = torch.finfo(model.dtype).bits // 8
    return 2 * config.num_hidden_layers * heads * head_dim * element


def output_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The output layer (and Gemma's final logit soft-capping) on chosen hidden states."""
    logits = model.get_output_embeddings()(hidden)
    cap = config_field(model, "final_logit_softcapping")
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


_HEAD_CHECKED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


@torch.inference_mode()
def output_head_reproduces_logits(model: Any, token_id: int, device: Any) -> bool:
    """Whether :func:`output_logits` on the decoder's hidden states gives the model's own
    logits (checked once per model, on two tokens): an architecture with other output
    transforms is refused by the batched path, not mis-scored."""
    if model not in _HEAD_CHECKED:
        matches = model.get_output_embeddings() is not None
        if matches:
            ids = torch.tensor([[token_id, token_id]], device=device)
            full = model(input_ids=ids).logits
            mine = output_logits(model, decoder(model)(input_ids=ids).last_hidden_state)
            matches = bool(torch.allclose(mine.float(), full.float(), atol=1e-4, rtol=1e-4))
        _HEAD_CHECKED[model] = matches
    return _HEAD_CHECKED[model]


# -- attention masks from real positions ------------------------------------------------------
def attention_mask(
    model: Any, key_pos: torch.Tensor, query_pos: torch.Tensor, device: Any
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4D attention mask (or one per layer type) of a batch whose cache slots carry real
    positions (``-1``: a hole or padding): causal, minus holes and padding, within each layer
    type's sliding window. A padded query (position -1) attends to itself only, so its unused
    output stays finite and never leaks NaN into the cache.

    transformers takes a ready 4D mask as it is (4.57 and 5.x), and a dict of them for
    models with several layer types (Gemma-3's sliding and full layers)."""
    config = text_config(model)
    implementation = config._attn_implementation
    if implementation not in ("sdpa", "eager"):
        raise UnsupportedModelError(
            f"batch_size>1 needs sdpa or eager attention; this model uses {implementation!r}: "
            "use batch_size=1"
        )
    layer_types = config_field(model, "layer_types")
    window = config_field(model, "sliding_window")
    if not layer_types:
        uses_window = config_field(model, "use_sliding_window")
        use = window if uses_window is None or uses_window else None
        return _mask(key_pos, query_pos, use, implementation, model.dtype, device)
    masks = {}
    for kind in set(layer_types):
        if kind == "full_attention":
            masks[kind] = _mask(key_pos, query_pos, None, implementation, model.dtype, device)
        elif kind == "sliding_attention":
            masks[kind] = _mask(key_pos, query_pos, window, implementation, model.dtype, device)
        else:
            raise UnsupportedModelError(
                f"batch_size>1 does not support {kind!r} layers ({type(model).__name__}); use batch_size=1"
            )
    return masks


def _mask(
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    window: int | None,
    implementation: str,
    dtype: torch.dtype,
    device: Any,
) -> torch.Tensor:
    keys = key_pos[:, None, :]
    queries = query_pos[:, :, None]
    allowed = (keys >= 0) & (keys <= queries)
    if window is not None:
        allowed &= queries - keys < window
    width = query_pos.shape[1]
    own = torch.zeros_like(allowed)
    own[:, :, -width:] = torch.eye(width, dtype=torch.bool)
    allowed = torch.where(queries < 0, own, allowed)[:, None]
    if implementation == "sdpa":
        return allowed.to(device)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min).to(device)
