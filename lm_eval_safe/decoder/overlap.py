"""Verification off the critical path (``overlap=``): while a verifier scores cycle k's window,
the drafter drafts cycle k+1's on the assumption that window k is kept.

Greedy drafting is deterministic, so the tokens drafted ahead are exactly those the next cycle
would draft, through the same forwards: they wait as carried tokens
(:meth:`~lm_eval_safe.decoder.member_runs.DrafterRun.draft_ahead`), and a replacement in window k
rolls them back with the rest of the window. The ensemble's decisions, and so the texts, are
those of ``overlap=off``; only when forwards run changes. Sampled requests never draft ahead:
their draws would come from the request's random stream in another order.

It pays where the forwards can run at once: members on different GPUs (``auto`` turns it on
there). On a CPU the members share the cores, and on this project's 2-core machine a
verifier's thread beside the drafter's measured slower than running them in turn
(measured in BENCHMARKS.md), so ``auto`` leaves it off; ``on`` forces it.
"""

from __future__ import annotations

from lm_eval_safe.decoder.batch_driver import Await, Launch, Steps
from lm_eval_safe.decoder.latency import CycleForwards
from lm_eval_safe.decoder.member_runs import DrafterRun
from lm_eval_safe.engines import engine
from lm_eval_safe.engines.base import Forward
from lm_eval_safe.members.member import Member


def overlap_enabled(mode: str, drafter: Member, verifiers: list[Member]) -> bool:
    """``on``/``off`` as given; ``auto``: every verifier on a GPU other than the drafter's.

    Members whose engine runs their forwards on a thread of ours only (its spec's
    ``thread_device``): an engine that overlaps its own work (vLLM's continuous batching in its
    engine core) has none, and refuses ``overlap=on`` when the options are checked."""
    if mode != "auto":
        return mode == "on"
    devices = [engine(m.engine.kind).thread_device(m) for m in (drafter, *verifiers)]
    if any(device is None for device in devices):
        return False
    drafter_device, verifier_devices = devices[0], devices[1:]
    return bool(verifiers) and all(
        device.type == "cuda" and device != drafter_device for device in verifier_devices
    )


def verify_beside_draft(
    steps: Steps, cycle: CycleForwards, drafter: DrafterRun | None, ahead: int
) -> Steps:
    """A schedule's steps, each verifier forward's rows counted in ``cycle``. With ``drafter``
    (overlap on, a greedy request) every verifier forward is launched instead of waited for,
    and the drafter drafts up to ``ahead`` tokens of the next window (in all) until its rows
    are in."""
    answer = None
    try:
        while True:
            step = steps.send(answer)
            if isinstance(step, Forward) and step.member > 0:
                cycle.verifiers[step.member - 1].append(len(step.ids))
                if drafter is not None:
                    pending = yield Launch(step)
                    before = len(drafter.carried)
                    yield from drafter.draft_ahead(pending, ahead)
                    ahead -= len(drafter.carried) - before
                    answer = yield Await(pending)
                    continue
            answer = yield step
    except StopIteration as stop:
        return stop.value
