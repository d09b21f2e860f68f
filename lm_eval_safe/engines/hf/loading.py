"""Loading a member as a transformers model in this process: device, dtype, ``device_map``,
the prefix store and the small-row linears that go with it."""

from __future__ import annotations

from typing import Any

from lm_eval_safe.disk_cache import cache_root
from lm_eval_safe.engines.spec import LoadedMember, MemberLoad
from lm_eval_safe.members.checkpoints import checkpoint_folder, load_pretrained
from lm_eval_safe.members.placement import pick_device, pick_dtype
from lm_eval_safe.members.sources import MemberSource, loading_errors


def load_weights(
    source: MemberSource,
    dtype: Any,
    trust_remote_code: bool,
    cache_dir: str | None,
    device_map: str | None = None,
) -> tuple[Any, Any]:
    """Model and tokenizer of a source; GGUF goes through the converted-weights cache.

    With ``device_map`` (``"auto"``: accelerate spreads the layers over the GPUs) the model is
    loaded straight onto its devices; a GGUF is first de-quantized on cpu into the cache and
    then loaded from there (always: the cache is the one way a GGUF member is loaded), so a
    member too large for one GPU never has to fit on one. The first run loads the folder it just
    wrote, as every later run does: one code path, the same model object (its name_or_path is
    the folder, which lm-eval's ``hf`` can load)."""
    location = checkpoint_folder(source, dtype, trust_remote_code, cache_dir)
    with loading_errors(source):
        return load_pretrained(location, dtype, trust_remote_code, device_map)


def load_hf_member(
    load: MemberLoad, fast_small_linear: str = "auto", prefix_cache_mb: float = 256
) -> LoadedMember:
    """Load one member onto ``load.device`` (checked: a device this machine lacks is an error),
    or with ``device_map="auto"`` spread by accelerate over the GPUs (``device`` then only picks
    the dtype: bfloat16 for ``cuda`` under ``dtype=auto``). ``load.top_logprobs``: ids of each
    verifier position's head read back from the device (:mod:`.heads`)."""
    from lm_eval_safe.engines.hf.engine import HFEngine
    from lm_eval_safe.engines.hf.prefix_cache import PrefixStore
    from lm_eval_safe.engines.hf.small_rows import SmallRowLinears

    source = load.source
    device = pick_device(load.device)
    torch_dtype = pick_dtype(load.dtype, device)
    model, tokenizer = load_weights(
        source, torch_dtype, load.trust_remote_code, load.cache_dir, load.device_map
    )
    if load.device_map is None:
        model.to(device)  # a dispatched model must not be moved: accelerate's hooks own it
    model.eval()
    small_rows = SmallRowLinears(model, fast_small_linear, cache_root(load.cache_dir), source.name)
    store = PrefixStore(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 else None
    return LoadedMember(
        tokenizer=tokenizer,
        config=model.config,
        generation_config=model.generation_config,
        engine=HFEngine(model, load.device_map, small_rows, store, load.top_logprobs),
        device=device,
        dtype=torch_dtype,
    )
