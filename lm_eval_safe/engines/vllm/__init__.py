"""The vLLM engine (``engine=vllm``): each member is one ``vllm.LLM`` (paged KV cache, prefix caching, continuous
batching, tensor parallelism), and every batch step of the decoder is one batched ``generate``
call per member for all the requests in the batch.

- a drafter's window is one request with ``max_tokens=n`` and ``logprobs=K`` (the draft and
  each position's head);
- a verifier's positions are read from ``prompt_logprobs=K`` of its whole sequence, submitted
  again each cycle: vLLM's prefix cache holds what an earlier cycle computed, so only the new
  tail runs through the model;
- a full distribution, where a decision needs one, is ``logprobs=-1`` at that position.

Rows are :class:`~lm_eval_safe.engines.base.TopLogprobs` heads; :mod:`lm_eval_safe.ensemble.certified`
decides from them exactly or asks for the full distribution, which is computed again in another
request and taken as the distribution its head describes
(:func:`~lm_eval_safe.engines.base.consistent_row`). Both are vLLM's log-probs as returned,
lm-eval vllm's numbers: over the model's whole output layer, the ids past the tokenizer dropped
with their mass. What vLLM on this package's supported versions needs, and what a CPU build does
differently, is in :mod:`.args`.

Modules: :mod:`.engine` (the member's engine), :mod:`.loading` (placement plan, building the
engine), :mod:`.args` (engine arguments), :mod:`.versions` (the tested vLLM releases),
:mod:`.batch` and :mod:`.sessions` (rows), :mod:`.scoring`. This module is the engine's
:class:`~lm_eval_safe.engines.spec.EngineSpec` and stays light: vLLM and torch are imported
when a member loads, so options are checked on machines without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval_safe.engines.spec import EngineSpec, LoadedMember, MemberLoad
from lm_eval_safe.errors import OptionError


class VLLMSpec(EngineSpec):
    name = "vllm"
    passthrough = True  # lm-eval vllm's model_args and vLLM's EngineArgs (.args)

    def take_arguments(self, raw: dict[str, Any], unknown: Sequence[str]) -> dict[str, Any]:
        """lm-eval vllm's names: ``max_model_len`` is ``max_length``, ``max_batch_size`` also
        sets ``max_num_seqs``; checked against the installed vLLM before any member loads."""
        args = {key: raw[key] for key in unknown}
        if "max_model_len" in raw:
            if raw.get("max_length") not in (None, ""):
                raise OptionError("give max_length= or max_model_len=, not both (they are one setting)")
            raw["max_length"] = args.pop("max_model_len")
        if "max_batch_size" in raw and "max_num_seqs" not in raw:
            args["max_num_seqs"] = raw["max_batch_size"]
        return args

    def check_options(self, options: Any) -> None:
        if options.top_logprobs < options.top_k:
            raise OptionError(
                f"top_logprobs={options.top_logprobs} is below top_k={options.top_k}: vLLM members must "
                "return at least the top_k strings the aggregator reads"
            )
        if options.overlap == "on":
            raise OptionError(
                "overlap=on runs transformers members on threads of their own; vLLM members "
                "overlap inside their engines: drop overlap=on"
            )

    def check_versions(self) -> None:
        from packaging.version import Version

        from lm_eval_safe.engines.vllm.args import require_vllm, vllm_version
        from lm_eval_safe.engines.vllm.versions import check_vllm_versions

        require_vllm()
        check_vllm_versions(Version(vllm_version()))

    def plan(
        self, options: Any, placements: Sequence[Any], indices: Sequence[int], rank: int, world_size: int
    ) -> list[dict[str, Any]]:
        from lm_eval_safe.engines.vllm.loading import plan_vllm_members

        return plan_vllm_members(options, placements, indices, rank, world_size)

    def load(self, load: MemberLoad, **settings: Any) -> LoadedMember:
        from lm_eval_safe.engines.vllm.loading import load_vllm_member

        return load_vllm_member(load, **settings)

    def generation_rows(self, members: Sequence[Any], jobs: Sequence[Any]) -> int:
        from lm_eval_safe.engines.vllm.batch import auto_generation_rows

        return auto_generation_rows(list(members), list(jobs))

    def serving_rows(self, members: Sequence[Any]) -> int | None:
        """Its request slots (continuous batching keeps the batch as full as clients make it)."""
        return self.generation_rows(members, [])


ENGINE = VLLMSpec()
