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
