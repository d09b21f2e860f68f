"""The batch scheduler: many requests' SAFE loops advanced in lock-step cycles over shared
member batches.

A request's decoding is a generator (:data:`Steps`): it yields each forward it needs (a
:class:`~lm_eval_safe.batching.Forward`, answered with the log-prob rows) and
:data:`CYCLE_END` after each SAFE cycle, where the batch waits for all its rows. The same
generator runs alone (:func:`drive`) or in a batch (:func:`run_batched`), so the text of a
request never depends on the batch size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any

from lm_eval_safe.batching import Forward, MemberBatch
from lm_eval_safe.members import Member

CYCLE_END = object()
Steps = Generator[Any, Any, Any]


class Row:
    """A request in the batch: its decoding steps and the forward it waits for (None: the
    cycle's end, or done)."""

    def __init__(self, index: int, steps: Steps):
        self.index = index
        self.steps = steps
        self.call: Forward | None = None
        self.done = False
        self.result: Any = None
        self._started = False

    def advance(self, answer: Any = None) -> None:
        if self.done:
            return
        try:
            step = self.steps.send(answer) if self._started else next(self.steps)
        except StopIteration as stop:
            self.done, self.call, self.result = True, None, stop.value
            return
        self._started = True
        self.call = None if step is CYCLE_END else step


def solo_batch(member: Member) -> MemberBatch:
    batch = MemberBatch(member)
    batch.add_row()
    return batch


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
    order: Sequence[int],
    start: Callable[[int], Steps],
    batch_size: int,
    on_done: Callable[[int, Any], None] | None = None,
) -> dict[int, Any]:
    """Decode the requests ``order`` names, ``batch_size`` rows at a time, ``start(i)`` giving
    request ``i``'s steps; returns each request's result by index.

    Rows advance in lock-step cycles: every row drafts (one batched forward of member 0 per
    step), then each other member serves the rows that need it in one batched forward, then each
    row accepts or rolls back on its own. A finished row is replaced by the next request at the
    cycle's end (continuous refill)."""
    batches = [MemberBatch(m) for m in members]
    queue = deque(order)
    results: dict[int, Any] = {}
    rows: list[Row] = []
    while queue or rows:
        while queue and len(rows) < max(1, batch_size):
            index = queue.popleft()
            for batch in batches:
                batch.add_row()
            rows.append(Row(index, start(index)))
        for row in rows:
            row.advance()
        # serve forwards, the lowest member first, until every row has ended its cycle
        while waiting := [(r, row.call) for r, row in enumerate(rows) if row.call is not None]:
            member = min(call.member for _, call in waiting)
            calls = {r: call for r, call in waiting if call.member == member}
            for r, out in batches[member].run(calls).items():
                rows[r].advance(out)
        alive = [r for r, row in enumerate(rows) if not row.done]
        for row in rows:
            if row.done:
                results[row.index] = row.result
                if on_done is not None:
                    on_done(row.index, row.result)
        for batch in batches:
            batch.keep_rows(alive)
        rows = [rows[r] for r in alive]
    return results
