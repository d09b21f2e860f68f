"""Engines: what computes a member's forwards (the seam is :mod:`lm_eval_safe.engines.base`).

- ``hf`` (:mod:`lm_eval_safe.engines.hf`): transformers models stepped by this project's own
  batches in this process; the default, and needs nothing beyond the package's dependencies.
- ``vllm`` (:mod:`lm_eval_safe.engines.vllm`): one vLLM engine per member (paged KV cache,
  prefix caching, continuous batching, tensor parallelism), answering each batch step with one
  ``generate`` call.

A third engine (SGLang, a served OpenAI-compatible endpoint) is one more folder implementing
:class:`~lm_eval_safe.engines.base.MemberEngine`. This module stays import-light: an engine's
package is imported only when a member is loaded on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

ENGINES = ("hf", "vllm")


def load_member(spec: str, *, engine: str = "hf", **settings: Any) -> Any:
    """Load one member on ``engine`` (``hf``: transformers in this process; ``vllm``: a vLLM
    engine); ``settings`` are that engine's loader's (:func:`.hf.loading.load_hf_member`,
    :func:`.vllm.loading.load_vllm_member`)."""
    if engine == "vllm":
        from lm_eval_safe.engines.vllm.loading import load_vllm_member

        return load_vllm_member(spec, **settings)
    from lm_eval_safe.engines.hf.loading import load_hf_member

    return load_hf_member(spec, **settings)


def load_members(opts: Any, placements: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """Every member of ``opts`` on its engine and placement. Every GGUF file, and vLLM's
    installation and arguments, are checked before the first member loads (that takes
    minutes)."""
    import os

    from lm_eval_safe.certified import head_width
    from lm_eval_safe.members import check_gguf_file, resolve_source

    for spec in opts.members:
        source = resolve_source(spec, opts.cache_dir)
        if source.kind == "gguf":
            check_gguf_file(source)
    engines = opts.member_engines()
    vllm_plans: Iterator[dict[str, Any]] = iter(())
    if "vllm" in engines:
        from lm_eval_safe.engines.vllm.loading import plan_vllm_members

        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        vllm_plans = iter(plan_vllm_members(opts, placements, world_size, local_rank))
    common = {
        "dtype": opts.dtype,
        "trust_remote_code": opts.trust_remote_code,
        "cache_dir": opts.cache_dir,
        "max_length": opts.max_length,
        "add_bos_token": opts.add_bos_token,
    }
    members = []
    for i, spec in enumerate(opts.members):
        if engines[i] == "vllm":
            member = load_member(spec, engine="vllm", index=i, **common, **next(vllm_plans))
        else:
            member = load_member(
                spec,
                index=i,
                device=placements[i].device,
                device_map=placements[i].device_map,
                fast_small_linear=opts.fast_small_linear,
                prefix_cache_mb=opts.prefix_cache_mb,
                top_logprobs=head_width(opts.top_logprobs, opts.top_k),
                **common,
            )
        members.append(member)
    return members


@contextmanager
def engines_active(members: Iterable[Any]) -> Iterator[None]:
    """Every member's engine settings active for the calls run inside this block (the
    transformers engine's small-row linears)."""
    with ExitStack() as stack:
        for member in members:
            stack.enter_context(member.engine.active())
        yield


def generation_rows(options: Any, members: Sequence[Any], jobs: Sequence[Any]) -> int:
    """Rows decoded together: ``batch_size`` as given; for ``auto`` the fewest that any
    engine's members hold (each engine sizes its own: GPU memory for transformers, the engine's
    ``max_num_seqs`` for vLLM), at most ``max_batch_size``."""
    if options.batch_size != "auto":
        return max(1, int(options.batch_size))
    if not jobs:
        return 1
    rows = []
    kinds = {m.engine.kind for m in members}
    if "hf" in kinds:
        from lm_eval_safe.engines.hf.batch import auto_generation_rows

        rows.append(auto_generation_rows([m for m in members if m.engine.kind == "hf"], jobs))
    if "vllm" in kinds:
        from lm_eval_safe.engines.vllm.batch import auto_generation_rows as vllm_rows

        rows.append(vllm_rows([m for m in members if m.engine.kind == "vllm"], jobs))
    return int(max(1, min(*rows, options.max_batch_size)))
