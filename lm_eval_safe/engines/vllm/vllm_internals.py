"""Every private vLLM object that resumable requests (:mod:`.sessions`) reach, in this module only.

Why one module: resumable requests drive vLLM's engine core, scheduler, KV-cache managers, block
pool and model runner directly, none of which vLLM promises to keep between releases. Each name
in :data:`PRIVATE_NAMES` was read in vLLM's source of the versions in :data:`TESTED_VERSIONS` and
is exercised by the session tests there. On any other version :func:`unsupported` says so (the
engine logs it in one line) and rows re-submit whole sequences through the public
``LLM.generate``: the same answers, at the cost of sending every row's whole sequence each call
and computing its last block again.

What a newer vLLM changes lands here. ``Scheduler._update_request_as_session`` decides which of
a paused request's output ids stay (as prompt) when its next chunk is added. vLLM 0.32 keeps the
ones its frontier computed, ``_all_token_ids[num_prompt_tokens : num_computed_tokens]``; vLLM 0.33
keeps every output id but the last, by count, whatever the frontier. On what this package leaves
behind the two agree: a finished chunk computed all its generated ids but the last
(:func:`kept_generated`), and :meth:`EngineInternals.rollback` makes the computed ids prompt and
leaves no output ids. The 0.33 branch would be: :meth:`~EngineInternals.rollback` must go on
clearing ``_output_token_ids`` (an output id left past the frontier would be fed again as prompt
on 0.33, dropped on 0.32), and :func:`kept_generated` would count ``_output_token_ids[:-1]``
rather than the frontier. Until the session tests have run on 0.33, 0.33 takes the public path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: vLLM releases (public version, local label dropped: ``0.32.0+cpu`` is ``0.32.0``) on which
#: every name below was read and the session tests passed.
TESTED_VERSIONS: tuple[str, ...] = ("0.32.0",)

#: The private names this module reaches, as ``Owner.attribute`` (``module:Class`` for a class
#: imported), so a new vLLM release is checked against one list.
PRIVATE_NAMES: tuple[str, ...] = (
    # engine and its in-process core client
    "LLMEngine.engine_core",
    "LLMEngine.input_processor.process_inputs(resumable=True)",
    "vllm.v1.engine.core_client:InprocClient",
    "InprocClient.engine_core",
    "InprocClient.add_request",
    "InprocClient.get_output",
    "InprocClient.abort_requests",
    "EngineCoreRequest.external_req_id",
    "EngineCore.scheduler",
    "EngineCore.model_executor.driver_worker.worker.model_runner",
    # a step's outputs
    "EngineCoreOutputs.outputs",
    "EngineCoreOutput.request_id",
    "EngineCoreOutput.new_token_ids",
    "EngineCoreOutput.new_logprobs (LogprobsLists.logprob_token_ids, .logprobs)",
    "EngineCoreOutput.new_prompt_logprobs_tensors (LogprobsTensors.logprob_token_ids, .logprobs)",
    "EngineCoreOutput.prefill_stats.num_cached_tokens",
    "EngineCoreOutput.finish_reason",
    # scheduler and KV-cache manager
    "Scheduler.requests",
    "Scheduler.block_size",
    "Scheduler.hash_block_size",
    "Scheduler.kv_cache_manager",
    "Scheduler._update_request_as_session (what a resumed request keeps)",
    "KVCacheManager.coordinator.single_type_managers",
    "KVCacheManager.block_pool",
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager",
    "vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager",
    "SingleTypeKVCacheManager.block_size",
    "SingleTypeKVCacheManager.req_to_blocks",
    "SingleTypeKVCacheManager.num_cached_block",
    "SingleTypeKVCacheManager.block_pool",
    "SlidingWindowManager.sliding_window",
    "BlockPool.null_block",
    "BlockPool.free_blocks",
    "BlockPool.get_num_free_blocks",
    # a scheduler request
    "vllm.v1.request:RequestStatus.WAITING_FOR_STREAMING_REQ",
    "Request.status",
    "Request.num_computed_tokens",
    "Request._all_token_ids",
    "Request._output_token_ids",
    "Request.prompt_token_ids",
    "Request.num_prompt_tokens",
    "Request.block_hashes",
    # model runner
    "GPUModelRunner._update_streaming_request (its presence tells the V1 runner)",
    "GPUModelRunner.requests",
    "GPUModelRunner.num_prompt_logprobs",
    "GPUModelRunner.device",
    "CachedRequestState.generator",
    "CachedRequestState.in_progress_prompt_logprobs_cpu",
)


def installed_version() -> str:
    """vLLM's public version (``0.32.0+cpu`` reads ``0.32.0``)."""
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).public


def unsupported(llm: Any) -> str | None:
    """Why sessions cannot run on this engine, or None where they can: an untested vLLM first
    (before any private name is read), then what the private objects cannot do."""
    version = installed_version()
    if version not in TESTED_VERSIONS:
        return (
            f"vLLM {version} is not a version its private objects were tested on "
            f"({', '.join(TESTED_VERSIONS)})"
        )
    from vllm.v1.engine.core_client import InprocClient

    engine = llm.llm_engine
    config = engine.vllm_config
    if not isinstance(engine.engine_core, InprocClient):
        return "the engine core runs in another process"
    if config.speculative_config is not None:
        return "speculative decoding"
    if config.scheduler_config.async_scheduling:
        return "asynchronous scheduling"
    if config.parallel_config.world_size != 1:
        return "more than one worker"
    if config.scheduler_config.max_num_seqs < 2:
        return "max_num_seqs below 2"
    runner = _runner(engine)
    if not hasattr(runner, "_update_streaming_request") or not hasattr(runner, "num_prompt_logprobs"):
        return "not vLLM's V1 model runner"
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager

    kinds = {type(m) for m in _scheduler(engine).kv_cache_manager.coordinator.single_type_managers}
    if not kinds <= {FullAttentionManager, SlidingWindowManager}:
        return "KV-cache layers other than full and sliding-window attention"
    return None


def kept_generated(generated: int) -> int:
    """How many of a finished chunk's ``generated`` ids its request holds computed when the next
    chunk is added: all but the last, which was sampled and never fed (vLLM 0.32: the ids up to
    the computed frontier; 0.33: every output id but the last; the same count here)."""
    return max(generated - 1, 0)


def _scheduler(engine: Any) -> Any:
    return engine.engine_core.engine_core.scheduler


def _runner(engine: Any) -> Any:
    return engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@dataclass(slots=True)
class StepOutput:
    """One request's output of one engine step, in plain values."""

    rid: str
    tokens: list[int]
    #: per generated token: (ids, log-probs), the token first, then the top K
    rows: list[tuple[list[int], list[float]]]
    #: (ids, log-probs) tensors of prompt log-probs, row j predicting the chunk's id j + 1
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor] | None
    #: ids read from the prefix cache (a new request's first output only)
    cached: int | None
    finished: bool


class EngineInternals:
    """One engine's private objects, reached through the few operations sessions need."""

    def __init__(self, llm: Any):
        engine = llm.llm_engine
        self._engine = engine
        self._client = engine.engine_core
        self._scheduler = _scheduler(engine)
        self._runner = _runner(engine)
        self._tasks = engine.get_supported_tasks()
        self.tokens_per_block = int(self._scheduler.block_size)
        self.max_num_seqs = int(engine.vllm_config.scheduler_config.max_num_seqs)

    # -- requests ----------------------------------------------------------------------
    def add(self, rid: str, ids: Sequence[int], params: Any) -> None:
        """A resumable request ``rid`` for ``ids``: a new one, or the paused ``rid``'s next chunk
        (vLLM's scheduler appends a known id's ids to what it computed)."""
        from vllm import TokensPrompt

        request = self._engine.input_processor.process_inputs(
            rid,
            TokensPrompt(prompt_token_ids=list(ids)),
            params,
            supported_tasks=self._tasks,
            resumable=True,
        )
        request.external_req_id = rid
        self._client.add_request(request)

    def prepare_chunk(self, rid: str, prompt_logprobs: int | None, seed: int | None) -> None:
        """Before the paused ``rid``'s next chunk is added: the runner registers prompt log-probs
        and a seed for new requests only, so the chunk's are set on its cached state here (a
        seed's generator draws what a new request with that seed draws)."""
        state = self._runner.requests[rid]
        if prompt_logprobs is not None:
            self._runner.num_prompt_logprobs[rid] = prompt_logprobs
            state.in_progress_prompt_logprobs_cpu = None
        state.generator = None
        if seed is not None:
            state.generator = torch.Generator(device=self._runner.device)
            state.generator.manual_seed(seed)

    def step(self) -> list[StepOutput]:
        """One engine step's outputs."""
        found = []
        for output in self._client.get_output().outputs:
            lists = output.new_logprobs
            rows = (
                list(zip(lists.logprob_token_ids.tolist(), lists.logprobs.tolist(), strict=True))
                if lists is not None
                else []
            )
            tensors = output.new_prompt_logprobs_tensors
            stats = output.prefill_stats
            found.append(
                StepOutput(
                    output.request_id,
                    output.new_token_ids,
                    rows,
                    None if tensors is None else (tensors.logprob_token_ids, tensors.logprobs),
                    None if stats is None else int(stats.num_cached_tokens),
                    output.finish_reason is not None,
                )
            )
        return found

    def abort(self, rids: Iterable[str]) -> None:
        self._client.abort_requests(list(rids))

    # -- state -------------------------------------------------------------------------
    def frontier(self, rid: str) -> int:
        """Leading ids of ``rid``'s sequence its KV holds."""
        return int(self._scheduler.requests[rid].num_computed_tokens)

    def free_block_count(self) -> int:
        return int(self._scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def kv_groups(self) -> int:
        return len(self._managers())

    def _managers(self) -> list[Any]:
        return list(self._scheduler.kv_cache_manager.coordinator.single_type_managers)

    def rollback(self, rid: str, n: int) -> int:
        """Roll the paused ``rid`` back to at most ``n`` computed ids; returns its frontier
        (``n``, or the start of ``n``'s block where that block is in the prefix cache: a
        published block is never written again). 0, with nothing changed: the request should
        be closed (nothing left, or a sliding-window layer already freed a block the frontier's
        window reaches back to), as vLLM reads a request with nothing computed as new.

        The scheduler's token lists and block hashes are cut, blocks past the frontier freed and
        the computed outputs made prompt, the state ``_update_request_as_session`` expects of a
        paused request whose chunk computed exactly ``frontier`` ids."""
        from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
        from vllm.v1.request import RequestStatus

        request = self._scheduler.requests[rid]
        if request.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            raise RuntimeError(f"session {rid} is not paused ({request.status})")
        managers = self._managers()
        frontier = min(n, request.num_computed_tokens)
        for manager in managers:
            size = manager.block_size
            if frontier < manager.num_cached_block.get(rid, 0) * size:
                frontier = frontier // size * size
        null = self._scheduler.kv_cache_manager.block_pool.null_block
        for manager in managers:
            window = manager.sliding_window if isinstance(manager, SlidingWindowManager) else None
            if window is not None:
                first = max(0, frontier - window + 1) // manager.block_size
                reached = manager.req_to_blocks[rid][first : -(-frontier // manager.block_size)]
                if any(block is null for block in reached):
                    frontier = 0
        if frontier == 0:
            return 0
        for manager in managers:
            size = manager.block_size
            blocks = manager.req_to_blocks[rid]
            kept = -(-frontier // size)
            tail = [block for block in blocks[kept:] if block is not null]
            del blocks[kept:]
            manager.block_pool.free_blocks(reversed(tail))
            published = manager.num_cached_block.get(rid, 0)
            manager.num_cached_block[rid] = min(published, frontier // size)
        del request._all_token_ids[frontier:]
        request.prompt_token_ids[:] = request._all_token_ids  # computed outputs become prompt
        request.num_prompt_tokens = frontier
        request._output_token_ids.clear()
        request.num_computed_tokens = frontier
        del request.block_hashes[frontier // self._scheduler.hash_block_size :]
        return frontier
