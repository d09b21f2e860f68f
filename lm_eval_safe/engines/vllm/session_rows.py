"""A generation batch's rows as resumable vLLM requests (:mod:`.sessions`): each call sends the
ids a row gained since its session last computed, rolling the session back first where the
decoder kept fewer ids than it holds (a replaced or rejected draft).

A chunk's answers are the rows vLLM computed for it: a drafter's ``logprobs=K`` at each drafted
token; a verifier's ``prompt_logprobs=K`` at the chunk's ids and ``logprobs=K`` after its last.
A new session reads the prefix cache, whose positions have no prompt log-probs (their rows are
not computed): those few are left to the caller, which asks them as a batch without sessions
does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lm_eval_safe.engines.base import TopLogprobs
from lm_eval_safe.engines.vllm.sessions import ChunkResult, EngineSessions, Session
from lm_eval_safe.engines.vllm.vllm_internals import kept_generated

#: (sequence the window was drafted after, drafted ids, each drafted id's (ids, log-probs) row)
Window = tuple[list[int], list[int], list[tuple[list[int], list[float]]]]


class SessionRows:
    """One batch's sessions in one member's engine, a row's session or None."""

    def __init__(self, engine: Any, pool: EngineSessions):
        self.engine = engine
        self.pool = pool
        self.sessions: list[Session | None] = []

    def add_row(self) -> None:
        self.sessions.append(None)

    def keep_rows(self, rows: list[int]) -> None:
        kept = set(rows)
        self.pool.close(s for r, s in enumerate(self.sessions) if r not in kept and s is not None)
        self.sessions = [self.sessions[r] for r in rows]

    def forget_after(self, row: int, valid: int) -> None:
        """The row's ids from ``valid`` on differ from what its session computed."""
        session = self.sessions[row]
        if session is not None:
            session.valid = min(session.valid, valid)

    def close(self) -> None:
        self.keep_rows([])

    # -- calls -------------------------------------------------------------------------
    def draft(
        self, requests: dict[int, tuple[list[int], int]], settings: dict[int, dict[str, Any]]
    ) -> dict[int, Window]:
        """Each row's window after ``(sequence, keep)``, with its sampling ``settings``."""
        windows: dict[int, Window] = {}
        for group in self._groups(list(requests)):
            chunks = self._submit(
                {r: requests[r] for r in group},
                {r: self.engine.params(**settings[r]) for r in group},
                {r: settings[r].get("seed") for r in group},
                extra=max(settings[r]["max_tokens"] for r in group),
            )
            results = self.pool.run([session for session, _ in chunks.values()])
            for row, (session, start) in chunks.items():
                sequence = requests[row][0]
                result = self._count(session, start, results)
                session.valid = len(sequence) + kept_generated(len(result.tokens))
                windows[row] = (sequence, result.tokens, result.rows)
        return windows

    def score(
        self, requests: dict[int, tuple[list[int], int, list[int]]]
    ) -> dict[int, dict[int, TopLogprobs | None]]:
        """For each row's ``(sequence, keep, positions)``, the head predicting each position its
        chunk computed (``len(sequence)``: the next token); None where vLLM's top ids cannot
        name the argmax."""
        engine = self.engine
        found: dict[int, dict[int, TopLogprobs | None]] = {}
        for group in self._groups(list(requests)):
            params = {
                r: engine.params(
                    max_tokens=1,
                    logprobs=engine.top,
                    prompt_logprobs=engine.top if any(p < len(requests[r][0]) for p in requests[r][2]) else None,
                    skip_reading_prefix_cache=False,
                )
                for r in group
            }
            chunks = self._submit(
                {r: requests[r][:2] for r in group}, params, dict.fromkeys(group), extra=1  # type: ignore[misc]
            )
            results = self.pool.run([session for session, _ in chunks.values()])
            for row, (session, start) in chunks.items():
                sequence, _, positions = requests[row]
                result = self._count(session, start, results)
                first = result.cached if start is None else start
                session.valid = len(sequence) + kept_generated(len(result.tokens))
                heads: dict[int, TopLogprobs | None] = {}
                for p in positions:
                    if p == len(sequence):
                        heads[p] = engine.position_head(*result.rows[0], (sequence, p))
                    elif p - 1 >= first:
                        assert result.prompt_logprobs is not None
                        ids, logprobs = result.prompt_logprobs
                        heads[p] = engine.position_head(
                            ids[p - 1].tolist(), logprobs[p - 1].tolist(), (sequence, p)
                        )
                found[row] = heads
        return found

    # -- sessions ----------------------------------------------------------------------
    def _groups(self, rows: list[int]) -> Iterator[list[int]]:
        """Rows in groups the engine's request slots hold at once."""
        size = self.pool.capacity
        for at in range(0, len(rows), size):
            yield rows[at : at + size]

    def _submit(
        self,
        requests: dict[int, tuple[list[int], int]],
        params: dict[int, Any],
        seeds: dict[int, int | None],
        extra: int,
    ) -> dict[int, tuple[Session, int | None]]:
        """Each row's chunk: the ids after what its session computed of ``sequence[:keep]``
        (rolled back first where it computed more), or a new session for the whole sequence.
        Returns each row's session and where its chunk starts (None: a new session, which
        starts after what it read from the prefix cache)."""
        pool = self.pool
        group = [self.sessions[r] for r in requests]
        held = [s for s in group if s is not None and s.open]
        needed = sum(
            pool.blocks_for(len(sequence) - self._valid(row) + extra)
            for row, (sequence, _) in requests.items()
        )
        pool.make_room(needed, held)
        chunks: dict[int, tuple[Session, int | None]] = {}
        counters = self.engine.counters
        for row, (sequence, keep) in requests.items():
            session = self.sessions[row]
            start = 0
            if session is not None and session.open:
                session.valid = min(session.valid, keep)
                start = min(session.valid, len(sequence) - 1, pool.frontier(session))
                if start < pool.frontier(session):
                    start = pool.truncate(session, start)
            if session is not None and session.open:
                pool.resume(session, sequence[start:], params[row], seeds[row])
                counters.prefill_tokens += len(sequence) - start
                chunks[row] = (session, start)
            else:
                session = pool.start(sequence, params[row], keep=held)
                held.append(session)
                self.sessions[row] = session
                counters.prefill_tokens += len(sequence)
                chunks[row] = (session, None)
        return chunks

    def _valid(self, row: int) -> int:
        session = self.sessions[row]
        return session.valid if session is not None and session.open else 0

    def _count(
        self, session: Session, start: int | None, results: dict[str, ChunkResult]
    ) -> ChunkResult:
        result = results[session.rid]
        if start is None:
            self.engine.counters.prefill_tokens_saved += result.cached
        return result
