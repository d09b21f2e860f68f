"""How many batched forwards a batch of requests needs, replayed from the cycles they ran.

A request's work is fixed by its text: each cycle drafts some tokens (one drafter forward each)
and then runs each verifier's forwards (:class:`~lm_eval_safe.decoder.latency.CycleForwards`).
Which of those forwards share a batched forward is the batch driver's choice, and the choice
is all that batching can change without changing a text. Replaying the same cycles under
other schedules says what a different driver could save before anyone writes one:

- :func:`lock_step`: the driver as it runs (:func:`~lm_eval_safe.decoder.batch_driver.
  run_batched`): every row drafts, then each verifier serves every row that asks, and the batch
  waits for its longest draft at each cycle's end. Compared with the forwards a run counted, it
  checks the replay itself.
- :func:`rows_apart`: no barrier at a cycle's end. Each step the drafter serves every row that
  is drafting; a verifier serves the rows waiting for it once ``verify_at`` of them wait (or
  nothing else can move). A row waiting for a verifier sits out the drafter's forwards, so a low
  ``verify_at`` fills the drafter's forwards and runs many thin verifier forwards, a high one
  the reverse.
- :func:`packing_bound`: fewer than this no schedule runs: each member's forwards packed
  ``batch_size`` rows to a forward, and never fewer than the longest request's chain of
  forwards (a row's forwards of one member run one after another).

Fresh rows' first forwards (a prompt's prefill) run alone in every schedule, as the
transformers engine prefills a prompt on its own and splices it into the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lm_eval_safe.decoder.latency import CycleForwards


@dataclass(frozen=True)
class Packing:
    """Forwards per member (drafter first) and the rows they served."""

    forwards: tuple[int, ...]
    rows: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.forwards)


def _members(requests: Sequence[Sequence[CycleForwards]]) -> int:
    return 1 + max((len(c.verifiers) for cycles in requests for c in cycles), default=0)


def _phases(cycle: CycleForwards, members: int) -> list[int]:
    """The forwards of one cycle, per member in the order they run (drafter, then verifiers)."""
    counts = [cycle.drafter, *(len(forwards) for forwards in cycle.verifiers)]
    return counts + [0] * (members - len(counts))


def lock_step(requests: Sequence[Sequence[CycleForwards]], batch_size: int) -> Packing:
    """Requests in order, ``batch_size`` rows at a time, a finished row's place taken at the
    next cycle's end; one round per cycle of every row."""
    members = _members(requests)
    forwards, rows = [0] * members, [0] * members
    waiting = list(range(len(requests)))
    running: dict[int, int] = {}  # request -> its next cycle
    started: list[set[int]] = [set() for _ in range(members)]  # requests a member has prefilled
    while waiting or running:
        while waiting and len(running) < batch_size:
            running[waiting.pop(0)] = 0
        for member in range(members):
            steps: set[int] = set()  # the round's batched steps of this member
            for request, index in running.items():
                count = _phases(requests[request][index], members)[member]
                if count and request not in started[member]:
                    started[member].add(request)
                    forwards[member] += 1  # the prefill, alone
                    steps.update(range(1, count))
                else:
                    steps.update(range(count))
                rows[member] += count
            forwards[member] += len(steps)
        running = {r: i + 1 for r, i in running.items() if i + 1 < len(requests[r])}
    return Packing(tuple(forwards), tuple(rows))


def rows_apart(
    requests: Sequence[Sequence[CycleForwards]], batch_size: int, verify_at: int
) -> Packing:
    """Requests in order, ``batch_size`` rows at a time, a finished row's place taken at once;
    each step one forward of the drafter for every drafting row, then one of each verifier for
    the rows waiting on it when ``verify_at`` of them wait or no row is drafting."""
    members = _members(requests)
    forwards, rows = [0] * members, [0] * members
    waiting = list(range(len(requests)))
    # request -> [cycle index, member whose forwards it needs, how many of them are left]
    running: dict[int, list[int]] = {}
    started: list[set[int]] = [set() for _ in range(members)]

    def settle() -> None:
        """Move rows past phases with nothing left, start new rows in the free places."""
        for request in list(running):
            state = running[request]
            while state[2] == 0:
                if state[1] + 1 < members:
                    state[1] += 1
                elif state[0] + 1 < len(requests[request]):
                    state[0], state[1] = state[0] + 1, 0
                else:
                    del running[request]
                    break
                state[2] = _phases(requests[request][state[0]], members)[state[1]]
        while waiting and len(running) < batch_size:
            request = waiting.pop(0)
            running[request] = [0, 0, _phases(requests[request][0], members)[0]]
            settle()

    settle()
    while running:
        drafting = [r for r, s in running.items() if s[1] == 0]
        for member in range(members):
            asking = [r for r, s in running.items() if s[1] == member]
            if not asking or (member and len(asking) < verify_at and drafting):
                continue
            fresh = [r for r in asking if r not in started[member]]
            started[member].update(fresh)
            forwards[member] += len(fresh) + (len(fresh) < len(asking))
            rows[member] += len(asking)
            for request in asking:
                running[request][2] -= 1
        settle()
    return Packing(tuple(forwards), tuple(rows))


def packing_bound(requests: Sequence[Sequence[CycleForwards]], batch_size: int) -> Packing:
    """Per member: every prefill alone, then the other forwards ``batch_size`` rows to a
    forward, and no fewer than the longest request's own chain of them."""
    members = _members(requests)
    forwards, rows = [], []
    for member in range(members):
        chains = [sum(_phases(c, members)[member] for c in cycles) for cycles in requests]
        prefills = sum(1 for chain in chains if chain)
        rest = [chain - 1 for chain in chains if chain]
        forwards.append(prefills + max(math.ceil(sum(rest) / batch_size), max(rest, default=0)))
        rows.append(sum(chains))
    return Packing(tuple(forwards), tuple(rows))


def best_rows_apart(
    requests: Sequence[Sequence[CycleForwards]], batch_size: int
) -> tuple[int, Packing]:
    """:func:`rows_apart` at the ``verify_at`` (1 to ``batch_size``) that runs the fewest
    forwards in all, with that ``verify_at``."""
    tried = {at: rows_apart(requests, batch_size, at) for at in range(1, max(1, batch_size) + 1)}
    at = min(tried, key=lambda k: (tried[k].total, k))
    return at, tried[at]
