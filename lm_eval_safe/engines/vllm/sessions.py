"""Resumable vLLM requests: a row's sequence stays in the engine between the decoder's calls, so
a call sends only the ids the row gained and computes only them.

Re-submitting a row's whole sequence each cycle lets vLLM's prefix cache supply what an earlier
call computed, but only in whole blocks, always recomputing the last block's ids (1-32 per row,
member and call on a CPU build), hashing and looking up the whole sequence, and computing prompt
log-probs at every recomputed position. vLLM 0.32's resumable (streaming-input) requests keep
their KV blocks while paused and resume at their computed frontier. Three things this package
needs are not in vLLM's API, and are done on the engine's own objects, every one of them reached
through :mod:`.vllm_internals` (which lists them and the vLLM versions they were tested on):

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
model runner, full or sliding-window attention, no speculative decoding and a tested vLLM
version (:func:`.vllm_internals.unsupported`); elsewhere a batch re-submits whole sequences.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lm_eval_safe.engines.vllm.vllm_internals import EngineInternals, unsupported

__all__ = ["STALL_STEPS", "ChunkResult", "EngineSessions", "Session", "unsupported"]

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
    #: (ids, log-probs) tensors of the chunk's prompt log-probs: row j predicts its id j + 1
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None
    cached: int = 0  # ids read from the prefix cache (a new request only)
    finished: bool = False


class EngineSessions:
    """The resumable requests of one member's engine, at most :attr:`capacity` at once (a paused
    one holds a request slot: one slot stays free for one-off requests), least recently used
    closed first."""

    def __init__(self, llm: Any):
        self._vllm = EngineInternals(llm)
        self._block_size = self._vllm.tokens_per_block
        self._names = itertools.count()
        self._live: OrderedDict[str, Session] = OrderedDict()
        self.capacity = self._vllm.max_num_seqs - 1

    @property
    def open_count(self) -> int:
        return len(self._live)

    # -- requests ----------------------------------------------------------------------
    def start(self, ids: Sequence[int], params: Any, keep: Iterable[Session] = ()) -> Session:
        """A new session for ``ids`` (read from the prefix cache where vLLM has them), closing
        the least recently used one not in ``keep`` where all are taken."""
        live = {s.rid for s in keep}
        while len(self._live) >= self.capacity:
            oldest = next((rid for rid in self._live if rid not in live), None)
            if oldest is None:
                raise RuntimeError(f"more rows than the engine's {self.capacity + 1} request slots")
            self.close([self._live[oldest]])
        rid = f"safe-{next(self._names)}"
        self._vllm.add(rid, ids, params)
        session = Session(rid)
        self._live[rid] = session
        return session

    def resume(self, session: Session, ids: Sequence[int], params: Any, seed: int | None) -> None:
        """The paused ``session``'s next chunk: ``ids`` after its computed frontier."""
        self._vllm.prepare_chunk(session.rid, params.prompt_logprobs, seed)
        self._vllm.add(session.rid, ids, params)
        self._live.move_to_end(session.rid)

    def run(self, sessions: Sequence[Session]) -> dict[str, ChunkResult]:
        """Step the engine until every session's chunk has finished."""
        results = {s.rid: ChunkResult() for s in sessions}
        pending = set(results)
        idle = 0
        while pending:
            outputs = self._vllm.step()
            idle = 0 if any(o.rid in pending for o in outputs) else idle + 1
            if idle > STALL_STEPS:
                raise RuntimeError(f"vLLM scheduled none of {len(pending)} requests")
            for output in outputs:
                result = results.get(output.rid)
                if result is None or output.rid not in pending:
                    continue
                if output.cached is not None:  # a new request's first output
                    result.cached = output.cached
                result.tokens.extend(output.tokens)
                result.rows.extend(output.rows)
                if output.prompt_logprobs is not None:
                    result.prompt_logprobs = output.prompt_logprobs
                if output.finished:
                    result.finished = True
                    pending.discard(output.rid)
        return results

    # -- state -------------------------------------------------------------------------
    def frontier(self, session: Session) -> int:
        return self._vllm.frontier(session.rid)

    def truncate(self, session: Session, n: int) -> int:
        """Roll the paused ``session`` back to at most ``n`` computed ids; returns its frontier
        (``n``, or the start of ``n``'s block where that block is in the prefix cache). A
        session left with nothing, or whose sliding-window layers already freed a block the
        frontier's window reaches back to, is closed (0)."""
        frontier = self._vllm.rollback(session.rid, n)
        if frontier == 0:  # vLLM reads a request with nothing computed as new: start one
            self.close([session])
            return 0
        session.valid = min(session.valid, frontier)
        return frontier

    def make_room(self, blocks: int, keep: Iterable[Session]) -> None:
        """Close paused sessions not in ``keep``, least recently used first, until ``blocks``
        KV blocks are free (a paused session's blocks are not vLLM's to evict)."""
        live = {s.rid for s in keep}
        for rid in [r for r in self._live if r not in live]:
            if self._vllm.free_block_count() >= blocks:
                return
            self.close([self._live[rid]])

    def blocks_for(self, tokens: int) -> int:
        """KV blocks ``tokens`` more ids may take (in every KV-cache group)."""
        return (-(-tokens // self._block_size) + 1) * self._vllm.kv_groups()

    def close(self, sessions: Iterable[Session]) -> None:
        sessions = list(sessions)
        rids = [s.rid for s in sessions if s.open]
        for s in sessions:
            s.open = False
            self._live.pop(s.rid, None)
        if rids:
            self._vllm.abort(rids)

    def close_all(self) -> None:
        self.close(list(self._live.values()))
