"""The batch scheduler: many requests' SAFE loops advanced in lock-step cycles over shared
member batches.

A request's decoding is a generator (:data:`Steps`): it yields each engine call it needs (a
:class:`~lm_eval_safe.engines.base.Draft`, :class:`~lm_eval_safe.engines.base.Forward` or
:class:`~lm_eval_safe.engines.base.Complete`, answered by the member's engine) and
:data:`CYCLE_END` after each SAFE cycle, where the batch waits for all its rows. The same
generator runs alone (:func:`drive`) or in a batch (:func:`run_batched`), so the text of a
request never depends on the batch size.

Overlap (``overlap=``, :mod:`lm_eval_safe.decoder.overlap`): a request may :class:`Launch` a verifier
forward instead of waiting for it, draft meanwhile, and :class:`Await` its rows. Every
verifier member runs its forwards on a thread of its own (one at a time, in the order asked),
the drafter on the calling thread, so a member's cache is only ever touched by one thread.

Where requests come from is a :class:`RequestSource`: a fixed list for lm-eval's
``generate_until`` (:class:`InOrder`), or a server's queue that blocks while the batch is empty,
so a request that arrives while others decode joins the batch at the next cycle's end and a
cancelled one leaves it there (:mod:`lm_eval_safe.serve.scheduler`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lm_eval_safe.engines.base import Call, Complete, Draft, EngineBatch, Forward
from lm_eval_safe.members.member import Member

#: Calls a member's engine answers (the rest are the driver's own: Launch, Await, CYCLE_END).
ENGINE_CALLS = (Draft, Forward, Complete)

CYCLE_END = object()
Steps = Generator[Any, Any, Any]


@dataclass
class Launch:
    """Start ``call`` (a verifier's forward) without waiting: answered at once with a
    :class:`Pending` whose ``done()`` says whether its rows are in."""

    call: Call


class Pending:
    """One row's share of a launched batched forward."""

    def __init__(self, future: Future, row: int):
        self.future = future
        self.row = row

    def done(self) -> bool:
        return self.future.done()

    def rows(self) -> torch.Tensor:
        return self.future.result()[self.row]


@dataclass
class Await:
    """Wait for a launched forward: answered with its log-prob rows."""

    pending: Pending


class RequestSource(Protocol):
    """Where :func:`run_batched` takes its requests from, by index."""

    def take(self, wait: bool) -> int | None:
        """The next request to start. None: none now (``wait`` false: the batch has rows to
        run), or none ever again (``wait`` true: the batch is empty, the run ends)."""
        ...

    def cancelled(self, index: int) -> bool:
        """Whether a running request should leave the batch at this cycle's end, unfinished."""
        ...

    def between_cycles(self) -> None:
        """Called at each cycle's end, when no member is in use (a server runs other work on
        the members there)."""
        ...


class InOrder:
    """A fixed list of requests in the order given; nothing is ever cancelled."""

    def __init__(self, order: Sequence[int]):
        self.queue = deque(order)

    def take(self, wait: bool) -> int | None:
        return self.queue.popleft() if self.queue else None

    def cancelled(self, index: int) -> bool:
        return False

    def between_cycles(self) -> None:
        pass


class Row:
    """A request in the batch: its decoding steps and the forward it waits for (None: the
    cycle's end, or done). With ``catch``, an exception raised by the request's own steps ends
    that row alone (``error``), so one bad request does not take its batch-mates down."""

    def __init__(self, index: int, steps: Steps, catch: bool = False):
        self.index = index
        self.steps = steps
        self.catch = catch
        self.call: Any = None
        self.done = False
        self.result: Any = None
        self.error: Exception | None = None
        self._started = False

    def advance(self, answer: Any = None) -> None:
        if self.done:
            return
        try:
            step = self.steps.send(answer) if self._started else next(self.steps)
        except StopIteration as stop:
            self.done, self.call, self.result = True, None, stop.value
            return
        except Exception as exc:
            if not self.catch:
                raise
            self.done, self.call, self.error = True, None, exc
            return
        self._started = True
        self.call = None if step is CYCLE_END else step


def solo_batch(member: Member) -> EngineBatch:
    batch = member.engine.new_batch()
    batch.add_row()
    return batch


def run_calls(member: Member, batch: EngineBatch, calls: dict[int, Call]) -> dict[int, Any]:
    """One batched engine call, counted and timed in the member's engine counters (engine calls
    per generated token, and the host time that is not spent inside them, in ``safe_stats``)."""
    start = time.perf_counter()
    answers = batch.run(calls)
    counters = member.engine.counters
    counters.calls += 1
    counters.seconds += time.perf_counter() - start
    return answers


def drive(steps: Steps, batches: Any) -> Any:
    """Run one request's steps on its own: ``batches[k]`` serves forwards of member ``k``."""
    row = Row(0, steps)
    row.advance()
    while not row.done:
        call = row.call
        row.advance(None if call is None else batches[call.member].run({0: call})[0])
    return row.result


def run_batched(
    members: Sequence[Member],
    source: RequestSource,
    start: Callable[[int], Steps],
    batch_size: int,
    on_done: Callable[[int, Any], None],
    threaded: bool = False,
    on_error: Callable[[int, Exception], None] | None = None,
) -> None:
    """Decode the requests ``source`` gives, up to ``batch_size`` rows at a time, ``start(i)``
    giving request ``i``'s steps; ``on_done(i, result)`` as each finishes.

    Rows advance in lock-step cycles: every row drafts (one batched forward of member 0 per
    step), then each other member serves the rows that need it in one batched forward, then each
    row accepts or rolls back on its own. At each cycle's end finished and cancelled rows leave,
    the last rows taking their places (:func:`gap_filling_order`), and the next requests join
    (continuous refill). ``threaded``: verifier members run on
    threads of their own, which rows that :class:`Launch` forwards need. ``on_error``: a
    request whose own steps raise ends alone, reported there (without it the run raises)."""
    batches = [m.engine.new_batch() for m in members]
    rows: list[Row] = []
    with ExitStack() as stack:
        threads: list[ThreadPoolExecutor | None] = [None] * len(members)
        if threaded:
            threads[1:] = [
                stack.enter_context(ThreadPoolExecutor(1, f"lm-eval-safe-{m.name}"))
                for m in members[1:]
            ]
        while True:
            while len(rows) < max(1, batch_size):
                index = source.take(wait=not rows)
                if index is None:
                    break
                for batch in batches:
                    batch.add_row()
                rows.append(Row(index, start(index), catch=on_error is not None))
            if not rows:
                return
            for row in rows:
                row.advance()
            while any(row.call is not None for row in rows):
                _serve(rows, members, batches, threads)
            alive = []
            for r, row in enumerate(rows):
                if row.done and row.error is not None and on_error is not None:
                    on_error(row.index, row.error)
                elif row.done:
                    on_done(row.index, row.result)
                elif source.cancelled(row.index):
                    row.steps.close()
                else:
                    alive.append(r)
            kept = gap_filling_order(alive)
            for batch in batches:
                batch.keep_rows(kept)
            rows = [rows[r] for r in kept]
            source.between_cycles()


def gap_filling_order(alive: list[int]) -> list[int]:
    """The rows that stay (ascending), in the order that moves the fewest: a row already among
    the first ``len(alive)`` positions keeps its place and each place a finished row left takes a
    row from past them. Shifting every row after a gap up instead moved the whole KV cache of
    most rows (prompts included) whenever an early row finished; a row's place in the batch
    changes nothing in its result."""
    count = len(alive)
    staying = {r for r in alive if r < count}
    movers = iter(r for r in alive if r >= count)
    return [r if r in staying else next(movers) for r in range(count)]


def _serve(
    rows: list[Row],
    members: Sequence[Member],
    batches: list[EngineBatch],
    threads: list[ThreadPoolExecutor | None],
) -> None:
    """One round of the rows' calls, in the order that keeps every member busy: plain forwards
    the lowest member first (the drafter's are the critical path), but launches before a
    verifier's plain forwards (one batched forward per member, started on its thread), and
    awaits only when nothing else is asked for. A verifier's plain forward runs on its thread
    too when it has one, after whatever that member has launched."""
    waiting = [(r, row.call) for r, row in enumerate(rows) if row.call is not None]
    forwards = {r: c for r, c in waiting if isinstance(c, ENGINE_CALLS)}
    launches = {r: c.call for r, c in waiting if isinstance(c, Launch)}
    lowest = min((c.member for c in forwards.values()), default=None)
    if lowest is not None and (lowest == 0 or not launches):
        calls = {r: c for r, c in forwards.items() if c.member == lowest}
        thread = threads[lowest]
        if thread is None:
            answers = run_calls(members[lowest], batches[lowest], calls)
        else:
            answers = thread.submit(run_calls, members[lowest], batches[lowest], calls).result()
        for r, out in answers.items():
            rows[r].advance(out)
        return
    if launches:
        for member in sorted({c.member for c in launches.values()}):
            calls = {r: c for r, c in launches.items() if c.member == member}
            thread = threads[member]
            if thread is None:
                raise RuntimeError("a Launch needs run_batched(threaded=True)")
            future = thread.submit(run_calls, members[member], batches[member], calls)
            for r in calls:
                rows[r].advance(Pending(future, r))
        return
    for r, call in waiting:  # only awaits are left
        rows[r].advance(call.pending.rows())
