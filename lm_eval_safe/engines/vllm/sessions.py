"""Resumable vLLM requests: a row's sequence stays in the engine between the decoder's calls, so
a call sends only the ids the row gained and computes only them.

Re-submitting a row's whole sequence each cycle lets vLLM's prefix cache supply what an earlier
call computed, but only in whole blocks, always recomputing the last block's ids (1-32 per row,
member and call on a CPU build), hashing and looking up the whole sequence, and computing prompt
log-probs at every recomputed position. vLLM 0.32's resumable (streaming-input) requests keep
their KV blocks while paused and resume at their computed frontier. Three things this package
needs are not in vLLM's API, and are done here on the engine's own objects, in one place:

- rolling a paused request back to fewer computed ids (a rejected draft): its token lists and
  block hashes are cut, blocks past the new frontier freed, and a block already published to the
  prefix cache is never written again (the frontier backs off to its start);
- prompt log-probs of a resumed chunk: the V1 model runner registers them for new requests
  only, so they are registered for the chunk here, between engine steps;
- a seed per chunk: the runner keeps the first chunk's random generator, so each chunk's is set
  here, which draws what a new request with that seed draws.

Each :class:`Session` is a cache: any may be closed at any time (too many for the engine's
request slots, too little KV memory, the prefix cache reset), and its row then starts a new one
from the prefix cache. Sessions are used where the engine runs in this process with vLLM's V1
model runner, one KV-cache group and no speculative decoding (:func:`unsupported`); elsewhere a
batch re-submits whole sequences.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Engine steps in a row that return nothing for any awaited request before a run is called
#: stuck (vLLM admitting none of them: no request slot or KV block left).
STALL_STEPS = 10_000


@dataclass
class Session:
    """One row's resumable request in one member's engine."""

    rid: str
    #: leading ids of the row's sequence that the request has computed (its KV holds them)
    valid: int = 0
    open: bool = True


@dataclass
class ChunkResult:
    """What one chunk of a session (or a one-off request) returned."""

    tokens: list[int] = field(default_factory=list)
    #: per generated token: (ids, log-probs), the token first, then the top K
    rows: list[tuple[list[int], list[float]]] = field(default_factory=list)
    prompt_logprobs: Any = None  # LogprobsTensors: row j predicts prompt id j + 1
    cached: int = 0  # ids read from the prefix cache (a new request only)
    finished: bool = False


def unsupported(llm: Any) -> str | None:
    """Why sessions cannot run on this engine, or None where they can."""
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


def _sliding_manager() -> type:
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    return SlidingWindowManager


def _scheduler(engine: Any) -> Any:
    return engine.engine_core.engine_core.scheduler


def _runner(engine: Any) -> Any:
    return engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


class EngineSessions:
    """The resumable requests of one member's engine, at most :attr:`capacity` at once (a paused
    one holds a request slot: one slot stays free for one-off requests), least recently used
    closed first."""

    def __init__(self, llm: Any):
        engine = llm.llm_engine
        self._engine = engine
        self._client = engine.engine_core
        self._scheduler = _scheduler(engine)
        self._runner = _runner(engine)
        self._tasks = engine.get_supported_tasks()
        self._block_size = int(self._scheduler.block_size)
        self._names = itertools.count()
        self._live: OrderedDict[str, Session] = OrderedDict()
        self.capacity = int(engine.vllm_config.scheduler_config.max_num_seqs) - 1

    @property
    def open_count(self) -> int:
        return len(self._live)

    # -- requests ----------------------------------------------------------------------
    def start(self, ids: Sequence[int], params: Any, keep: Iterable[Session] = ()) -> Session:
        """A new session for ``ids`` (read from the prefix cache where vLLM has them), closing
        the least recently used one not in ``keep`` where all are taken."""
        from vllm import TokensPrompt

        live = {s.rid for s in keep}
        while len(self._live) >= self.capacity:
            oldest = next((rid for rid in self._live if rid not in live), None)
            if oldest is None:
                raise RuntimeError(f"more rows than the engine's {self.capacity + 1} request slots")
            self.close([self._live[oldest]])
        rid = f"safe-{next(self._names)}"
        request = self._engine.input_processor.process_inputs(
            rid,
            TokensPrompt(prompt_token_ids=list(ids)),
            params,
            supported_tasks=self._tasks,
            resumable=True,
        )
        request.external_req_id = rid
        self._client.add_request(request)
        session = Session(rid)
        self._live[rid] = session
        return session

    def resume(self, session: Session, ids: Sequence[int], params: Any, seed: int | None) -> None:
        """The paused ``session``'s next chunk: ``ids`` after its computed frontier."""
        from vllm import TokensPrompt

        request = self._engine.input_processor.process_inputs(
            session.rid,
            TokensPrompt(prompt_token_ids=list(ids)),
            params,
            supported_tasks=self._tasks,
            resumable=True,
        )
        request.external_req_id = session.rid
        state = self._runner.requests[session.rid]
        if params.prompt_logprobs is not None:
            self._runner.num_prompt_logprobs[session.rid] = params.prompt_logprobs
            state.in_progress_prompt_logprobs_cpu = None
        state.generator = None
        if seed is not None:
            state.generator = torch.Generator(device=self._runner.device)
            state.generator.manual_seed(seed)
        self._client.add_request(request)
        self._live.move_to_end(session.rid)

    def run(self, sessions: Sequence[Session]) -> dict[str, ChunkResult]:
        """Step the engine until every session's chunk has finished."""
        results = {s.rid: ChunkResult() for s in sessions}
        pending = set(results)
        idle = 0
        while pending:
            outputs = self._client.get_output().outputs
            idle = 0 if any(o.request_id in pending for o in outputs) else idle + 1
            if idle > STALL_STEPS:
                raise RuntimeError(f"vLLM scheduled none of {len(pending)} requests")
            for output in outputs:
                result = results.get(output.request_id)
                if result is None or output.request_id not in pending:
                    continue
                if output.prefill_stats is not None:  # a new request's first output
                    result.cached = int(output.prefill_stats.num_cached_tokens)
                result.tokens.extend(output.new_token_ids)
                lists = output.new_logprobs
                if lists is not None:
                    result.rows.extend(
                        zip(lists.logprob_token_ids.tolist(), lists.logprobs.tolist(), strict=True)
                    )
                if output.new_prompt_logprobs_tensors is not None:
                    result.prompt_logprobs = output.new_prompt_logprobs_tensors
                if output.finish_reason is not None:
                    result.finished = True
                    pending.discard(output.request_id)
        return results

    # -- state -------------------------------------------------------------------------
    def frontier(self, session: Session) -> int:
        return int(self._scheduler.requests[session.rid].num_computed_tokens)

    def truncate(self, session: Session, n: int) -> int:
        """Roll the paused ``session`` back to at most ``n`` computed ids; returns its frontier
        (``n``, or the start of ``n``'s block where that block is in the prefix cache). A
        session left with nothing, or whose sliding-window layers already freed a block the
        frontier's window reaches back to, is closed (0)."""
        from vllm.v1.request import RequestStatus

        request = self._scheduler.requests[session.rid]
        if request.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            raise RuntimeError(f"session {session.rid} is not paused ({request.status})")
        managers = self._managers()
        frontier = min(n, request.num_computed_tokens)
        for manager in managers:
            size = manager.block_size
            if frontier < manager.num_cached_block.get(session.rid, 0) * size:
                frontier = frontier // size * size
        null = self._scheduler.kv_cache_manager.block_pool.null_block
        for manager in managers:
            window = manager.sliding_window if isinstance(manager, _sliding_manager()) else None
            if window is not None:
                first = max(0, frontier - window + 1) // manager.block_size
                reached = manager.req_to_blocks[session.rid][first : -(-frontier // manager.block_size)]
                if any(block is null for block in reached):
                    frontier = 0
        if frontier == 0:  # vLLM reads a request with nothing computed as new: start one
            self.close([session])
            return 0
        for manager in managers:
            size = manager.block_size
            blocks = manager.req_to_blocks[session.rid]
            kept = -(-frontier // size)
            tail = [block for block in blocks[kept:] if block is not null]
            del blocks[kept:]
            manager.block_pool.free_blocks(reversed(tail))
            published = manager.num_cached_block.get(session.rid, 0)
            manager.num_cached_block[session.rid] = min(published, frontier // size)
        del request._all_token_ids[frontier:]
        request.prompt_token_ids[:] = request._all_token_ids  # computed outputs become prompt
        request.num_prompt_tokens = frontier
        request._output_token_ids.clear()
        request.num_computed_tokens = frontier
        del request.block_hashes[frontier // self._scheduler.hash_block_size :]
        session.valid = min(session.valid, frontier)
        return frontier

    def _managers(self) -> list[Any]:
        return list(self._scheduler.kv_cache_manager.coordinator.single_type_managers)

    def make_room(self, blocks: int, keep: Iterable[Session]) -> None:
        """Close paused sessions not in ``keep``, least recently used first, until ``blocks``
        KV blocks are free (a paused session's blocks are not vLLM's to evict)."""
        pool = self._scheduler.kv_cache_manager.block_pool
        live = {s.rid for s in keep}
        for rid in [r for r in self._live if r not in live]:
            if pool.get_num_free_blocks() >= blocks:
                return
            self.close([self._live[rid]])

    def blocks_for(self, tokens: int) -> int:
        """KV blocks ``tokens`` more ids may take (in every KV-cache group)."""
        return (-(-tokens // self._block_size) + 1) * len(self._managers())

    def close(self, sessions: Iterable[Session]) -> None:
        sessions = list(sessions)
        rids = [s.rid for s in sessions if s.open]
        for s in sessions:
            s.open = False
            self._live.pop(s.rid, None)
        if rids:
            self._client.abort_requests(rids)

    def close_all(self) -> None:
        self.close(list(self._live.values()))
